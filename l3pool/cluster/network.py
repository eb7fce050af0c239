"""The local cluster's network (`l3pool.cluster.local`): a bridge in the root namespace and, per
agent K, a network namespace `{name}-a{K}` joined to it by a veth pair, in one IPv4 subnet:

    root namespace                                    namespace {name}-a{K}
    bridge {name}-br0 = .1  <── veth {name}-v{K} ──>  eth0 = .(10+K)

`ClusterNetwork` creates them (refusing names that exist; without a given subnet, in the first
10.77.N.0/24 no interface overlaps) and records every name it created in `links` / `netns` as it
goes, calling `saved()` after each so the cluster's state file lists it before the next step: a
launcher killed midway leaves nothing `l3pool cluster down` cannot delete. Deleting is
`delete()` (or `_os._delete_network` over the recorded names). Whether to use namespaces at all,
and the loopback fallback, is the cluster's decision (`LocalCluster._setup_network`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field

from l3pool.cluster._os import ClusterError, _delete_network, _existing_links, _existing_netns, _ip, _subnet_user


class NetworkTaken(ClusterError):
    """Names or addresses of the network are already in use (never a reason to fall back)."""


@dataclass
class ClusterNetwork:
    """The bridge, namespaces and veths of cluster `name` with `agents` agents in `subnet`
    (`auto`: none was given, take the first free 10.77.N.0/24 instead)."""

    name: str
    agents: int
    subnet: ipaddress.IPv4Network
    auto: bool
    saved: Callable[[], None]
    links: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.name}-br0"

    @property
    def bridge_ip(self) -> str:
        """The root namespace's address on the bridge (what its clients advertise)."""
        return str(self.subnet.network_address + 1)

    def namespace(self, k: int) -> str:
        return f"{self.name}-a{k}"

    def agent_ip(self, k: int) -> str:
        return str(self.subnet.network_address + 10 + k)

    def create(self) -> None:
        """Refuse names already in use, then create everything in the given or first free subnet."""
        self._check_names_free()
        self._create_in_free_subnet()

    def delete(self) -> None:
        """Delete what this object created (and forget it)."""
        _delete_network(self.links, self.netns)
        self.links, self.netns = [], []

    def _check_names_free(self) -> None:
        """Refuse to touch link or namespace names that already exist."""
        mine = {self.bridge, *(f"{self.name}-v{k}" for k in range(self.agents))}
        taken = sorted(mine & _existing_links())
        taken += sorted({self.namespace(k) for k in range(self.agents)} & _existing_netns())
        if taken:
            raise NetworkTaken(
                f"network names already in use: {', '.join(taken)} (another cluster named {self.name!r} is up? "
                "stop it with `l3pool cluster down --name NAME`, or pick another name)"
            )

    def _create_in_free_subnet(self) -> None:
        """The given subnet, or (none given) the first 10.77.N.0/24 no interface overlaps."""
        candidates = [ipaddress.IPv4Network(f"10.77.{n}.0/24") for n in range(256)] if self.auto else []
        for net in candidates or [self.subnet]:
            user = _subnet_user(net)
            if user is not None and not self.auto:
                raise NetworkTaken(f"subnet {net} overlaps {user}; pick another subnet")
            if user is not None:
                continue
            self.subnet = net
            self._create()
            if self.auto and _subnet_user(net, ignore=self.links[0]) is not None:
                self.delete()  # a concurrent cluster took it meanwhile
                continue
            return
        raise NetworkTaken("no free subnet among 10.77.0.0/24 ... 10.77.255.0/24; give one with subnet=")

    def _create(self) -> None:
        br, host, plen = self.bridge, self.bridge_ip, self.subnet.prefixlen
        _ip("link", "add", br, "type", "bridge")
        self.links.append(br)
        self.saved()
        # addrgenmode none: no IPv6 link-local addresses, so no DAD/router solicitations either;
        # the only traffic on these links is IPv4 inside the subnet.
        _ip("link", "set", br, "addrgenmode", "none")
        _ip("addr", "add", f"{host}/{plen}", "dev", br)
        _ip("link", "set", br, "up")
        for k in range(self.agents):
            ns, veth = self.namespace(k), f"{self.name}-v{k}"
            _ip("netns", "add", ns)
            self.netns.append(ns)
            self.saved()
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.links.append(veth)
            self.saved()
            _ip("link", "set", veth, "addrgenmode", "none")
            _ip("-n", ns, "link", "set", "eth0", "addrgenmode", "none")
            _ip("link", "set", veth, "master", br, "up")
            _ip("-n", ns, "addr", "add", f"{self.agent_ip(k)}/{plen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", "default", "via", host)
