"""Network addresses as users type them: the one HOST:PORT parser (no torch, no I/O)."""

from __future__ import annotations

import ipaddress
import re

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
