"""MooncakeStore's client rebuild against `FakeBinding` (tests/l3pool/fake_store.py) in place of
Mooncake's binding, with a listening socket as the master's port: a failing client is replaced with
every buffer registered again, the old one is closed only after the call still inside it returns
(and that call's failure does not trip the breaker of the new client), and a donor never rebuilds.
The real-cluster cases are in test_store_recover.py; dead-donor marks in test_donors.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from l3pool.pool import connection
from l3pool.pool.connection import Connection
from l3pool.pool.store import MooncakeStore, Outcome, StoreConfig

from ..fake_store import FakeBinding


@pytest.fixture
def master(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """host:port of a listening socket (the kernel accepts; nothing answers) with the fake binding
    installed and the master's HTTP server taken as answering."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    FakeBinding.instances, FakeBinding.fail_new = [], False
    monkeypatch.setattr(connection, "import_mooncake", lambda: FakeBinding)
    monkeypatch.setattr(Connection, "master_answers", lambda self: True)
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


def _cfg(master: str, **kw: object) -> StoreConfig:
    kw = {"rebuild_after_s": 0.2, "probe_backoff_s": (0.02, 0.05), **kw}
    return StoreConfig(master=master, metadata="http://127.0.0.1:1/metadata", **kw)  # type: ignore[arg-type]


def _until(cond: object, timeout: float = 5.0) -> None:
    assert callable(cond)
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.01)


def test_failing_client_is_rebuilt_and_closed_after_its_last_call(master: str) -> None:
    st = MooncakeStore(_cfg(master))
    try:
        st.register(0x1000, 4096)
        st.register(0x1000, 4096)  # a second reference: registered once
        st.register(0x9000, 512)
        old = FakeBinding.instances[0]
        old.fail, old.hold = True, threading.Event()
        held: list[list[Outcome]] = []
        th = threading.Thread(target=lambda: held.append(st.get(["k"], [0x1000], [64])))
        th.start()
        assert old.inside.wait(5)
        assert st.exists(["a", "b"]) == [Outcome.UNAVAILABLE] * 2  # trips; the probe fails too
        _until(lambda: len(FakeBinding.instances) == 2 and st.healthy())
        new = FakeBinding.instances[1]
        assert new.registered == {0x1000: 4096, 0x9000: 512}
        assert st.stats()["rebuilds"] == 1 and st.conn.current.s is new
        assert not old.closed  # a call is still inside it
        old.hold.set()
        th.join(5)
        assert held == [[Outcome.UNAVAILABLE]]  # the old client's answer, as it was
        _until(lambda: old.closed)
        assert not st.breaker.is_open  # ...which does not trip the new client's breaker
        assert st.get(["k"], [0x1000], [64]) == [Outcome.OK]
        st.unregister(0x9000)
        assert new.registered == {0x1000: 4096}
    finally:
        st.close()
    assert new.closed


def test_a_rebuild_that_fails_keeps_the_old_client(master: str) -> None:
    st = MooncakeStore(_cfg(master))
    try:
        st.register(0x1000, 4096)
        FakeBinding.instances[0].fail = True
        real = FakeBinding.register_buffer
        FakeBinding.register_buffer = lambda self, p, s: -600  # type: ignore[method-assign,assignment,misc]
        try:
            st.exists(["a"])
            _until(lambda: st.stats()["rebuild_failures"] >= 1)
        finally:
            FakeBinding.register_buffer = real  # type: ignore[method-assign]
        assert st.conn.current.s is FakeBinding.instances[0] and st.stats()["rebuilds"] == 0
        _until(lambda: FakeBinding.instances[1].closed)  # the half-built client is closed
    finally:
        st.close()


def test_a_donor_never_rebuilds(master: str) -> None:
    st = MooncakeStore(_cfg(master, segment_bytes=16 << 20))
    try:
        FakeBinding.instances[0].fail = True
        assert st.exists(["a"]) == [Outcome.UNAVAILABLE]
        time.sleep(0.6)  # three rebuild_after_s
        assert st.breaker.is_open and len(FakeBinding.instances) == 1 and st.stats()["rebuilds"] == 0
    finally:
        st.close()
