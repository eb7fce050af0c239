"""OS plumbing of the local cluster (`l3pool.cluster.local`): its processes (identified by pid + start
time, signalled by process group), free ports and listening sockets, and the iproute2 calls that
create and delete network namespaces, veths and the bridge."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("l3pool.cluster.local")
_GRACE_S = 5.0


class ClusterError(RuntimeError):
    """The local cluster could not be started, or a command on it failed."""


@dataclass
class _Proc:
    role: str  # "etcd" | "master" | "agent"
    id: str
    pid: int
    pgid: int
    start_time: int  # /proc/<pid>/stat field 22: identifies the process across pid reuse
    log: str
    cmd: list[str]
    netns: str | None = None
    ip: str | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    log_from: int = 0  # where this run's output starts in the (appended) log

    def tail(self) -> str:
        """The end of this run's log, for error messages."""
        return f"last lines of {self.log}:\n{_log_tail(self.log, self.log_from)}"

    def to_json(self) -> dict[str, Any]:
        keys = ("role", "id", "pid", "pgid", "start_time", "log", "cmd", "netns", "ip")
        return {k: getattr(self, k) for k in keys}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Proc:
        return cls(
            str(d["role"]), str(d["id"]), int(d["pid"]), int(d["pgid"]), int(d["start_time"]), str(d["log"]),
            list(d["cmd"]), d.get("netns"), d.get("ip"),
        )  # fmt: skip


# -- processes -------------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a pid, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return rest[0], int(rest[19])


def _proc_state(p: _Proc) -> str:
    """'alive', 'zombie' (exited, not reaped) or 'gone' (also: the pid now belongs to another process)."""
    if p.popen is not None:
        p.popen.poll()  # reap our own children
    st = _proc_stat(p.pid)
    if st is None or st[1] != p.start_time:
        return "gone"
    return "zombie" if st[0] in ("Z", "X") else "alive"


def _alive(p: _Proc) -> bool:
    return _proc_state(p) == "alive"


def _signal(p: _Proc, sig: int) -> bool:
    """Signal p's process group, but only while its leader is verifiably still ours; SIGSTOP
    returns once the whole group is stopped (`freeze_group`)."""
    if _proc_state(p) == "gone":
        return False
    if sig == signal.SIGSTOP:
        return freeze_group(p.pgid)
    try:
        os.killpg(p.pgid, sig)
    except ProcessLookupError:
        return False
    return True


def freeze_group(pgid: int, timeout: float = 2.0) -> bool:
    """SIGSTOP a process group and wait until every thread of every process in it is stopped ('T'):
    kill() only queues the signal, and a thread already running can still answer a request in
    between. False when the group is gone or not frozen within `timeout` s."""
    try:
        os.killpg(pgid, signal.SIGSTOP)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while True:
        states: list[str] = []
        for pid in (d for d in os.listdir("/proc") if d.isdigit()):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                if int(rest[2]) != pgid:
                    continue
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
        if states and all(s in ("T", "t", "Z", "X") for s in states):  # stopped, or dead: answers nothing
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


def _wait_dead(procs: Sequence[_Proc], timeout: float) -> list[_Proc]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if _alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _stop(procs: Sequence[_Proc], grace: float = _GRACE_S) -> list[_Proc]:
    """SIGTERM every group, SIGKILL what is left after `grace` s; returns the ones still alive."""
    for p in procs:
        _signal(p, signal.SIGTERM)
    left = _wait_dead(procs, grace)
    for p in left:
        log.warning("%s (pid %d) ignored SIGTERM for %.0f s: SIGKILL", p.id, p.pid, grace)
        _signal(p, signal.SIGKILL)
    left = _wait_dead(left, 5.0)
    for p in procs:
        if _proc_state(p) == "zombie":  # the leader exited; kill stragglers left in its group
            _signal(p, signal.SIGKILL)
        if p.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=1.0)
    for p in left:
        log.error("%s (pid %d) survived SIGKILL", p.id, p.pid)
    return left


def _log_tail(path: str | Path, start: int = 0, lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("0.0.0.0", 0))  # free on every address, so also on the bridge IP
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _listening(pid: int) -> set[int]:
    """TCP ports on which process `pid` itself holds a listening socket (so a port that another
    process grabbed between our choice and the server's bind never counts as ready)."""
    inodes: dict[str, int] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                parts = line.split()
                if parts[3] == "0A":  # TCP_LISTEN
                    inodes[parts[9]] = int(parts[1].rsplit(":", 1)[1], 16)
    ports = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    ports.add(inodes[link[8:-1]])
    return ports


# -- network namespaces ----------------------------------------------------------------------
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`ip ARGS`; without iproute2 (`ip` missing) the answer is an empty failure, so listing links
    and namespaces finds none (a loopback cluster needs neither) and `check=True` raises ClusterError."""
    if shutil.which("ip") is None:
        if check:
            raise ClusterError(f"`ip {' '.join(args)}`: iproute2 is not installed (Debian: apt-get install iproute2)")
        return subprocess.CompletedProcess(["ip", *args], 127, "", "ip: not installed")
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if check and r.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {r.stderr.strip() or r.returncode}")
    return r


def _netns_unavailable(mode: str) -> str | None:
    if mode == "off":
        return "netns='off' was asked for"
    if os.geteuid() != 0:
        return "not running as root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


def _existing_netns() -> set[str]:
    return {line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()}


def _existing_links() -> set[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2}


def _subnet_user(net: ipaddress.IPv4Network, ignore: str = "") -> str | None:
    """'ADDR on IFACE' of the first root-namespace address overlapping `net`, or None."""
    for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        parts = line.split()
        if "inet" in parts and parts[1] != ignore:
            addr = parts[parts.index("inet") + 1]
            if ipaddress.ip_interface(addr).network.overlaps(net):
                return f"{addr} on {parts[1]}"
    return None


def _delete_network(links: Sequence[str], netns: Sequence[str]) -> list[str]:
    """Delete the given links (reverse order: veths before their bridge) and namespaces; returns errors."""
    errors = []
    for name in reversed(links):
        r = _ip("link", "del", name, check=False)
        if r.returncode != 0 and "Cannot find device" not in r.stderr:
            errors.append(f"link {name}: {r.stderr.strip()}")
    for ns in netns:
        r = _ip("netns", "del", ns, check=False)
        if r.returncode != 0 and "No such file" not in r.stderr:
            errors.append(f"netns {ns}: {r.stderr.strip()}")
    for e in errors:
        log.warning("cleanup: %s", e)
    return errors


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM during teardown (so a second Ctrl-C cannot leave half a cluster); re-raise after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda n, _f: got.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            signal.raise_signal(got[0])
