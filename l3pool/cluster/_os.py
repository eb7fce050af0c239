"""OS plumbing of the local cluster (`l3pool.cluster.local`) besides its processes (those are in
`processes`): the iproute2 calls that create and delete network namespaces, veths and the bridge,
and signals held during teardown."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence

log = logging.getLogger("l3pool.cluster.local")


class ClusterError(RuntimeError):
    """The local cluster could not be started, or a command on it failed."""


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
