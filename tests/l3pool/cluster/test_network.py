"""ClusterNetwork without root: iproute2 replaced by a fake host that records every `ip` call, so
the names, addresses, subnet choice and the record-as-you-go order are checked on any machine
(tests/l3pool/cluster/test_cluster.py creates real namespaces when it runs as root)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

import pytest

from l3pool.cluster import network
from l3pool.cluster.network import ClusterNetwork, NetworkTaken


@dataclass
class FakeHost:
    used: dict[str, str] = field(default_factory=dict)  # subnet -> "ADDR on IFACE"
    links: set[str] = field(default_factory=set)
    netns: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)  # `ip` calls, deletions and saves, in order

    def network(self, monkeypatch: pytest.MonkeyPatch, subnet: str | None) -> ClusterNetwork:
        """A two-agent ClusterNetwork over this host (`subnet` None: auto)."""
        monkeypatch.setattr(network, "_ip", lambda *a, **_: self.calls.append(" ".join(a)))
        monkeypatch.setattr(network, "_existing_links", lambda: self.links)
        monkeypatch.setattr(network, "_existing_netns", lambda: self.netns)
        monkeypatch.setattr(network, "_subnet_user", lambda net, ignore="": self.used.get(str(net)))
        monkeypatch.setattr(network, "_delete_network", lambda ls, ns: self.calls.append(f"delete {ls} {ns}"))
        net = ipaddress.IPv4Network(subnet or "10.77.0.0/24")
        n = ClusterNetwork("t", 2, net, subnet is None, lambda: self.calls.append(f"saved {n.links} {n.netns}"))
        return n


def test_names_addresses_and_each_name_saved_before_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    host = FakeHost()
    n = host.network(monkeypatch, "10.9.8.0/24")
    n.create()
    assert (n.bridge, n.bridge_ip, n.namespace(1), n.agent_ip(1)) == ("t-br0", "10.9.8.1", "t-a1", "10.9.8.11")
    assert n.links == ["t-br0", "t-v0", "t-v1"] and n.netns == ["t-a0", "t-a1"]
    made = [c for c in host.calls if c.startswith(("link add", "netns add", "saved"))]
    assert made == [
        "link add t-br0 type bridge", "saved ['t-br0'] []",
        "netns add t-a0", "saved ['t-br0'] ['t-a0']",
        "link add t-v0 type veth peer name eth0 netns t-a0", "saved ['t-br0', 't-v0'] ['t-a0']",
        "netns add t-a1", "saved ['t-br0', 't-v0'] ['t-a0', 't-a1']",
        "link add t-v1 type veth peer name eth0 netns t-a1", "saved ['t-br0', 't-v0', 't-v1'] ['t-a0', 't-a1']",
    ]  # fmt: skip
    assert "addr add 10.9.8.1/24 dev t-br0" in host.calls and "-n t-a1 addr add 10.9.8.11/24 dev eth0" in host.calls
    assert host.calls[-1] == "-n t-a1 route add default via 10.9.8.1"


def test_auto_takes_the_first_free_subnet(monkeypatch: pytest.MonkeyPatch) -> None:
    host = FakeHost(used={"10.77.0.0/24": "10.77.0.1/24 on other-br0", "10.77.1.0/24": "10.77.1.5/16 on eth9"})
    n = host.network(monkeypatch, None)
    n.create()
    assert n.subnet == ipaddress.IPv4Network("10.77.2.0/24") and n.bridge_ip == "10.77.2.1"


def test_taken_names_or_given_subnet_are_refused_before_anything_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    host = FakeHost(links={"t-v1"}, netns={"t-a0"})
    with pytest.raises(NetworkTaken, match=r"network names already in use: t-v1, t-a0 \(another cluster named 't'"):
        host.network(monkeypatch, "10.9.8.0/24").create()
    assert host.calls == []
    host = FakeHost(used={"10.9.8.0/24": "10.9.8.3/24 on eth1"})
    with pytest.raises(NetworkTaken, match=re.escape("subnet 10.9.8.0/24 overlaps 10.9.8.3/24 on eth1; pick another")):
        host.network(monkeypatch, "10.9.8.0/24").create()
    assert host.calls == []


def test_delete_forgets_what_it_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    host = FakeHost()
    n = host.network(monkeypatch, "10.9.8.0/24")
    n.create()
    n.delete()
    assert host.calls[-1] == "delete ['t-br0', 't-v0', 't-v1'] ['t-a0', 't-a1']" and n.links == n.netns == []
