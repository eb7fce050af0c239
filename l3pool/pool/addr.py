"""Network addresses and URLs as users type them: the one HOST:PORT parser, the metadata and
master-admin URL checks (no torch, no I/O)."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


def check_host(host: str, what: str) -> str:
    """`host` if it is an IP address or a host name; ValueError naming `what` otherwise."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.fullmatch(host):
            raise ValueError(f"{what} {host!r}: not an IP address or host name") from None
    return host


def split_host_port(value: str, what: str = "address") -> tuple[str, int]:
    """'10.0.0.1:50051' or '[::1]:50051' -> (host, port); ValueError naming `what` otherwise."""
    host, sep, port = value.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {value!r}: expected HOST:PORT")
    check_host(host, what)
    return host, int(port)


def check_metadata_url(url: str, what: str = "metadata") -> str:
    """A Mooncake transfer-engine metadata URL (P2PHANDSHAKE, http://HOST:PORT/metadata or
    etcd://HOST:PORT) as given; ValueError naming `what` otherwise."""
    if url == "P2PHANDSHAKE":
        return url
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        u, port = None, None
    if u is None or u.scheme not in ("http", "etcd") or not u.hostname or port is None:
        raise ValueError(f"{what} {url!r}: expected P2PHANDSHAKE, http://HOST:PORT/metadata or etcd://HOST:PORT")
    check_host(u.hostname, what)
    return url


def check_admin_url(url: str, what: str = "--master-admin") -> str:
    """mooncake_master's admin (metrics) URL as a client uses it: http(s)://HOST:PORT, "http://"
    added to a bare HOST:PORT, no trailing slash; ValueError naming `what` otherwise."""
    text = url.strip().rstrip("/")
    full = text if "://" in text else f"http://{text}"
    try:
        u = urlsplit(full)
        ok = u.scheme in ("http", "https") and bool(u.hostname) and u.port is not None and u.path == ""
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{what} {url!r}: expected http://HOST:PORT (the master's --metrics_port)")
    check_host(u.hostname or "", what)
    return full
