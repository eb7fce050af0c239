"""DeadDonors (l3pool/pool/donors.py) against real sockets on loopback: an endpoint is marked dead
only while it refuses TCP connects, re-checked every retry_s and forgotten after forget_s; puts are
steered to live endpoints seen in replica descriptors, in turn, only while one is dead."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator

import pytest

from l3pool.pool.donors import DeadDonors, rpc_address

from ..conftest import free_port


@pytest.fixture
def listening() -> Iterator[str]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


def test_marks_are_rechecked_and_forgotten() -> None:
    """A marked endpoint stays dead while it refuses connections, is tried again once it accepts
    them (re-checked every retry_s), and is forgotten after forget_s."""
    d = DeadDonors(retry_s=0.05, forget_s=0.5)
    port = free_port()
    ep, other = f"127.0.0.1:{port}", "127.0.0.1:1"
    assert d.mark([ep, other, ep], 0.0, "get") == 2
    assert d.counts["dead_endpoints_marked"] == 2 and len(d) == 2
    time.sleep(0.1)
    assert d.dead_now() == {ep, other}  # re-checked: still refused
    srv = socket.socket()
    srv.bind(("127.0.0.1", port))
    srv.listen(4)
    try:
        time.sleep(0.1)
        assert d.dead_now() == {other}  # accepts again: its objects are tried for real
    finally:
        srv.close()
    assert len(d) == 1
    time.sleep(0.5)
    assert d.dead_now() == frozenset() and len(d) == 0


def test_an_endpoint_that_accepts_is_never_marked(listening: str) -> None:
    d = DeadDonors(retry_s=1.0, forget_s=10.0)
    assert d.mark([listening], 1.0, "put") == 0
    assert d.dead_now() == frozenset() and d.counts["dead_endpoints_marked"] == 0


def test_puts_are_steered_to_live_endpoints_only_while_one_is_dead(listening: str) -> None:
    d = DeadDonors(retry_s=1.0, forget_s=10.0)
    dead = f"127.0.0.1:{free_port()}"
    live2 = "127.0.0.1:2"  # refuses too, but is never handed to mark(): only seen
    d.saw([dead, listening, live2])
    assert d.steer() is None  # nothing dead: Mooncake places it
    assert d.mark(d.seen()[:2], 0.9, "put") == 1  # the dead one; the listening one accepts
    picks = [d.steer() for _ in range(6)]
    assert set(picks) == {listening, live2} and picks[0] != picks[1], picks  # in turn, never the dead one
    assert d.counts["steered_puts"] == 6
    d2 = DeadDonors(retry_s=1.0, forget_s=10.0)
    d2.saw([dead])
    d2.mark([dead], 0.9, "put")
    assert d2.steer() is None  # no live endpoint known: Mooncake places it


def test_http_metadata_gives_the_address_to_connect_to(listening: str) -> None:
    """With an http:// metadata server the segment name is not what listens: the donor's
    `mooncake/rpc_meta/<segment>` record (read with the key URL-encoded) names its transfer
    engine's RPC address, and that decides; no record: nothing proves it dead, it is not marked."""
    host, port = listening.rsplit(":", 1)
    segment = f"127.0.0.1:{free_port()}"  # refuses connects, like a live donor's segment name
    dead_segment, dead_rpc = "127.0.0.1:3", free_port()
    records = {
        f"mooncake/rpc_meta/{segment}": {"ip_or_host_name": host, "rpc_port": int(port)},
        f"mooncake/rpc_meta/{dead_segment}": {"ip_or_host_name": "127.0.0.1", "rpc_port": dead_rpc},
    }
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            raw = self.path.partition("?key=")[2]
            asked.append(raw)
            rec = records.get(urllib.parse.unquote(raw)) if "/" not in raw else None  # 0.3.13: raw keys 404
            body = json.dumps(rec).encode()
            self.send_response(200 if rec else 404)
            self.end_headers()
            self.wfile.write(body if rec else b"")

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/metadata"
        assert rpc_address(url, segment, 1.0) == listening
        d = DeadDonors(retry_s=1.0, forget_s=10.0, metadata=url)
        assert d.mark([segment, dead_segment, "127.0.0.1:4"], 1.0, "get") == 1
        assert d.dead_now() == {dead_segment}  # the live one listens on its RPC port; no record: unproven
        assert len([a for a in asked if segment.replace(":", "%3A") in a]) == 2  # rpc_address above, then mark
        etcd = DeadDonors(retry_s=1.0, forget_s=10.0, metadata="etcd://127.0.0.1:2379")
        assert etcd.mark([dead_segment], 1.0, "get") == 0  # no etcd read here: never marked
    finally:
        srv.shutdown()
        srv.server_close()
