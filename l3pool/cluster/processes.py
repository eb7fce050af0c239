"""Processes of the local cluster and of the tests' servers: each started in its own process group
(`spawn`), identified by pid + start time so a recycled pid is never signalled (`Proc`), stopped
by group (`stop`: SIGTERM, SIGKILL after a grace period), frozen (`freeze_group`); free ports and
the ports a process itself listens on (`free_ports`, `listening`); the end of a log for error
messages (`log_tail`)."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from l3pool.paths import open_log

log = logging.getLogger("l3pool.cluster.local")  # the local cluster's logger, which its users configure
GRACE_S = 5.0


@dataclass
class Proc:
    """A process started by `spawn` (or read back from a cluster's state file: no `popen`)."""

    role: str  # the cluster's: "etcd" | "master" | "agent"
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
        return f"last lines of {self.log}:\n{log_tail(self.log, self.log_from)}"

    def to_json(self) -> dict[str, Any]:
        keys = ("role", "id", "pid", "pgid", "start_time", "log", "cmd", "netns", "ip")
        return {k: getattr(self, k) for k in keys}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Proc:
        return cls(
            str(d["role"]), str(d["id"]), int(d["pid"]), int(d["pgid"]), int(d["start_time"]), str(d["log"]),
            list(d["cmd"]), d.get("netns"), d.get("ip"),
        )  # fmt: skip


# -- processes -------------------------------------------------------------------------------
def spawn(
    role: str, pid_id: str, cmd: Sequence[str], log_path: str | Path, *, netns: str | None = None,
    ip: str | None = None, cwd: str | Path | None = None, env: dict[str, str] | None = None,
) -> Proc:  # fmt: skip
    """Start `cmd` (inside `ip netns exec NETNS` when `netns` is given) in a process group of its
    own, stdout and stderr appended to `log_path` after a line naming the command and the time."""
    full = ["ip", "netns", "exec", netns, *cmd] if netns else list(cmd)
    with open_log(Path(log_path)) as f:
        log_from = f.tell()
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(full)}\n".encode())
        f.flush()
        popen = subprocess.Popen(
            full, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd, env=env
        )
    st = proc_stat(popen.pid)
    return Proc(role, pid_id, popen.pid, popen.pid, st[1] if st else 0, str(log_path), full, netns, ip, popen, log_from)


def stat_fields(pid: int, tid: int | None = None) -> list[str] | None:
    """The fields of /proc/<pid>/stat (of thread `tid`: /proc/<pid>/task/<tid>/stat) after the
    command name: proc(5)'s field N is [N - 3] (3, the state letter, is [0]); None when the process
    is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a pid, or None when there is no such process."""
    rest = stat_fields(pid)
    return None if rest is None else (rest[0], int(rest[19]))


def proc_state(p: Proc) -> str:
    """'alive', 'zombie' (exited, not reaped) or 'gone' (also: the pid now belongs to another process)."""
    if p.popen is not None:
        p.popen.poll()  # reap our own children
    st = proc_stat(p.pid)
    if st is None or st[1] != p.start_time:
        return "gone"
    return "zombie" if st[0] in ("Z", "X") else "alive"


def alive(p: Proc) -> bool:
    return proc_state(p) == "alive"


def signal_proc(p: Proc, sig: int) -> bool:
    """Signal p's process group, but only while its leader is verifiably still ours; SIGSTOP
    returns once the whole group is stopped (`freeze_group`)."""
    if proc_state(p) == "gone":
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
        for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
            rest = stat_fields(pid)
            if rest is None or int(rest[2]) != pgid:  # gone meanwhile, or another group's
                continue
            with contextlib.suppress(OSError):  # exited meanwhile
                threads = (stat_fields(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task"))
                states += [t[0] for t in threads if t]
        if states and all(s in ("T", "t", "Z", "X") for s in states):  # stopped, or dead: answers nothing
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)


def wait_dead(procs: Sequence[Proc], timeout: float) -> list[Proc]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def stop(procs: Sequence[Proc], grace: float = GRACE_S) -> list[Proc]:
    """SIGTERM every group, SIGKILL what is left after `grace` s; returns the ones still alive."""
    for p in procs:
        signal_proc(p, signal.SIGTERM)
    left = wait_dead(procs, grace)
    for p in left:
        log.warning("%s (pid %d) ignored SIGTERM for %.0f s: SIGKILL", p.id, p.pid, grace)
        signal_proc(p, signal.SIGKILL)
    left = wait_dead(left, 5.0)
    for p in procs:
        if proc_state(p) == "zombie":  # the leader exited; kill stragglers left in its group
            signal_proc(p, signal.SIGKILL)
        if p.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=1.0)
    for p in left:
        log.error("%s (pid %d) survived SIGKILL", p.id, p.pid)
    return left


def log_tail(path: str | Path, start: int = 0, lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def free_ports(n: int) -> list[int]:
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


def listening(pid: int) -> set[int]:
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
