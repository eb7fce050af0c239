"""The suite's own etcd and mooncake_master (conftest's run_etcd / run_master): a port another
process takes between choosing and binding is retried on new ports, the process group is gone
afterwards, and a server that never gets ready fails with its log's last lines."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from l3pool.cluster.processes import Proc, proc_stat, spawn

from . import conftest
from .conftest import run_etcd, run_master, serve


@pytest.fixture
def busy_first(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """free_ports' first answer names a port that is already taken; returns the sizes asked for."""
    held = socket.socket()
    held.bind(("0.0.0.0", 0))
    held.listen()
    real, calls = conftest.free_ports, []

    def free_ports(n: int) -> list[int]:
        ports = real(n)
        calls.append(n)
        if len(calls) == 1:
            ports[0] = held.getsockname()[1]
        return ports

    monkeypatch.setattr(conftest, "free_ports", free_ports)
    try:
        yield calls
    finally:
        held.close()


def test_etcd_retries_a_taken_port(busy_first: list[int]) -> None:
    with run_etcd() as etcd:
        client = etcd.client()
        try:
            assert client.status()
        finally:
            client.close()
        pid = etcd.proc.pid
    assert busy_first == [2, 2] and proc_stat(pid) is None


def test_master_retries_a_taken_port(busy_first: list[int]) -> None:
    with run_master() as master:
        assert master.segments() == []
        pid = master.proc.pid
    assert busy_first == [3, 3] and proc_stat(pid) is None


class _Sleeper:
    def __init__(self, tmp: Path) -> None:
        self.proc: Proc = spawn("sleeper", "sleeper", ["sleep", "60"], tmp / "sleeper.log")


def test_a_server_never_ready_fails_with_its_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "START_TIMEOUT", 0.5)
    started: list[_Sleeper] = []

    def start(tmp: Path, attempt: int) -> _Sleeper:
        started.append(_Sleeper(tmp))
        return started[-1]

    with pytest.raises(RuntimeError, match=r"(?s)sleeper not ready within 0.5 s; last lines of .*sleeper.log:\n=== "):
        with serve("sleeper", 3, start, lambda s: False):
            pass
    assert len(started) == 1 and proc_stat(started[0].proc.pid) is None
