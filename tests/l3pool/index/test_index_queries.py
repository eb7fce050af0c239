"""The index's query path (l3pool/index/queries.py) over real TCP sockets on 127.0.0.1: queries are
answered while the event loop is busy, a broken client is cut off without hurting the others, a
client survives the service's restart on the same port, and endpoints are parsed strictly."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from l3pool.index.client import IndexClient, IndexUnavailable
from l3pool.index.queries import MAX_FRAME, frame, parse_endpoint
from l3pool.index.service import IndexService
from l3pool.index.table import GlobalIndex
from l3pool.index.types import TierPrefix
from l3pool.pool import kv_events as kv

pytestmark = pytest.mark.usefixtures("index_native")
KEYS = np.arange(1, 33, dtype=np.uint64)


def _index() -> GlobalIndex:
    gi = GlobalIndex(10_000)
    for name, tier, n in (("a", 0, 20), ("b", 1, 9)):
        gi.add_instance(name)
        gi.apply(name, "ns", np.array([[tier, 1, n]], dtype=np.int64), KEYS[:n])
        gi.set_live(name, True)
    return gi


@pytest.fixture
def svc() -> Iterator[IndexService]:
    s = IndexService(_index(), silent_s=60).start()
    yield s
    s.close()


def test_answers_are_the_tables(svc: IndexService) -> None:
    with IndexClient(svc.endpoint, timeout_s=2.0) as c:
        for n in (0, 1, 9, 20, 32):
            h = c.query(KEYS[:n], "ns")
            assert h == svc.index.query(KEYS[:n], "ns")
        h = c.query(KEYS, "ns")
        assert h.of("a") == TierPrefix(20, 20, 20) and h.of("b") == TierPrefix(0, 9, 9) and h.pages == 32
        assert c.query(KEYS, "other").of("a") == TierPrefix(0, 0, 0)  # another namespace's salt


def test_a_query_does_not_wait_for_the_event_loop(svc: IndexService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop thread stuck for 1.5 s (as in a long ingestion turn): queries keep their latency."""
    real = svc._commands
    stuck = threading.Event()

    def slow(poller: object) -> None:
        stuck.set()
        time.sleep(1.5)
        real(poller)  # type: ignore[arg-type]

    monkeypatch.setattr(svc, "_commands", slow)
    svc.pool_member_left()  # wakes the loop, which then sleeps in _commands
    assert stuck.wait(5)
    with IndexClient(svc.endpoint, timeout_s=1.0) as c:
        t0 = time.perf_counter()
        for _ in range(20):
            assert c.query(KEYS, "ns").of("a").l1 == 20
        assert time.perf_counter() - t0 < 0.75


def test_a_broken_client_is_cut_off_and_the_others_are_served(svc: IndexService) -> None:
    host, port = parse_endpoint(svc.endpoint)
    bad = socket.create_connection((host, port), timeout=2)
    half = socket.create_connection((host, port), timeout=2)
    try:
        half.sendall(struct.pack("<I", 100) + b"only part of a frame")  # then silence
        bad.sendall(struct.pack("<I", MAX_FRAME + 1))  # no such request: the connection is closed
        assert bad.recv(16) == b""
        with IndexClient(svc.endpoint, timeout_s=2.0) as c:
            assert c.query(KEYS, "ns").of("a").l1 == 20  # the stalled and the closed ones block nothing
        assert svc._queries.bad_frames == 1
        # several requests in one write: answered in order
        body = kv.encode_request("query", "ns", KEYS[:5].tobytes())
        half.sendall(b"x" * 80)  # completes the stalled frame (garbage: an error answer)
        half.sendall(frame(body) + frame(kv.encode_request("status")))
        got = b""
        answers: list[list[object]] = []
        while len(answers) < 3:
            got += half.recv(1 << 16)
            while len(got) >= 4 and len(got) >= 4 + struct.unpack_from("<I", got)[0]:
                n = struct.unpack_from("<I", got)[0]
                answers.append(kv.decode_request(got[4 : 4 + n]))
                got = got[4 + n :]
        assert answers[0][0] == "err" and answers[1][0] == "ok" and answers[1][1] == 5
        assert answers[2][0] == "ok" and "instances" in answers[2][1]  # type: ignore[operator]
    finally:
        bad.close()
        half.close()


def test_the_client_reconnects_after_the_service_restarted() -> None:
    s1 = IndexService(_index()).start()
    ep = s1.endpoint
    c = IndexClient(ep, timeout_s=2.0)
    try:
        assert c.query(KEYS, "ns").of("a").l1 == 20
        s1.close()
        with pytest.raises(IndexUnavailable, match="did not answer"):  # nobody listens now
            c.query(KEYS, "ns")
        with IndexService(_index(), listen=ep).start():  # the same port again
            assert c.query(KEYS, "ns").of("b").l2 == 9
            assert c.status()["endpoint"] == ep
    finally:
        c.close()


def test_a_silent_service_times_out() -> None:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)  # accepts connections (the kernel does), never answers
    try:
        t0 = time.monotonic()
        with IndexClient(f"tcp://127.0.0.1:{ls.getsockname()[1]}", timeout_s=0.3) as c:
            with pytest.raises(IndexUnavailable, match="within 300 ms"):
                c.query(KEYS)
        assert time.monotonic() - t0 < 2
    finally:
        ls.close()


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [
        ("tcp://127.0.0.1:5757", ("127.0.0.1", 5757)),
        ("tcp://*:0", ("0.0.0.0", 0)),
        ("tcp://[::1]:80", ("::1", 80)),
        ("localhost:1", None),
        ("ipc:///tmp/x", None),
        ("tcp://host", None),
        ("tcp://:80", None),
        ("tcp://h:99999", None),
    ],
)
def test_endpoints(endpoint: str, ok: tuple[str, int] | None) -> None:
    if ok is None:
        with pytest.raises(ValueError, match="tcp://host:port"):
            parse_endpoint(endpoint)
    else:
        assert parse_endpoint(endpoint) == ok


def test_a_taken_port_is_one_value_error(svc: IndexService) -> None:
    with pytest.raises(ValueError, match="cannot listen"):
        IndexService(GlobalIndex(100), listen=svc.endpoint)


@pytest.mark.parametrize(
    ("kw", "name"),
    [({"poll_s": 0}, "poll_s"), ({"retry_s": -1.0}, "retry_s"), ({"silent_s": float("nan")}, "silent_s"),
     ({"snapshot_timeout_s": "1"}, "snapshot_timeout_s"), ({"age_s": True}, "age_s")],
)  # fmt: skip
def test_bad_service_settings_name_the_setting(kw: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}: expected a number >= 0.001"):
        IndexService(GlobalIndex(100), **kw)  # type: ignore[arg-type]
