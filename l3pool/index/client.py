"""`IndexClient`: the global index's answers in another process (a router, a tool), over TCP.

    c = IndexClient("tcp://127.0.0.1:5757", timeout_s=1.0)
    hits = c.query(page_hashes, namespace=ns_id)     # types.PrefixHits, one round trip
    c.status()                                       # the service's status dict
    c.close()

One TCP connection, kept open (l3pool/index/queries.py: length-prefixed msgpack frames); a
connection the service closed meanwhile (it restarted) is opened again once per call. A request
that gets no answer within `timeout_s`, or an index that refuses the connection, raises
`IndexUnavailable` (the connection is then dropped, so the next call starts clean); an error the
service answered raises `IndexRequestError`. Not thread-safe: one client per thread. Torch-free
(imports neither the index table nor l2core). A router asks through guard.GuardedIndex instead:
its answers come within a deadline whatever the index does (a breaker, a fallback it names).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

from l3pool.index.queries import frame, parse_endpoint
from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.pool.kv_events import WireError, decode_request, encode_request, keys64


class IndexUnavailable(RuntimeError):
    """The index did not answer in time (not running, wrong endpoint, overloaded)."""


class IndexRequestError(RuntimeError):
    """The index refused the request (malformed input)."""


class _Closed(Exception):
    """The service closed the connection."""


class IndexClient:
    def __init__(self, endpoint: str, timeout_s: float = 1.0) -> None:
        self.address = parse_endpoint(endpoint)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.endpoint, self.timeout_s = endpoint, float(timeout_s)
        self.timeout_ms = max(1, int(timeout_s * 1e3))
        self._sock: socket.socket | None = None

    def _connect(self, deadline: float) -> socket.socket:
        if self._sock is None:
            try:
                s = socket.create_connection(self.address, timeout=max(1e-3, deadline - time.monotonic()))
            except OSError as e:
                raise IndexUnavailable(f"the index at {self.endpoint} did not answer: {e}") from None
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = s
        return self._sock

    def _recv(self, s: socket.socket, n: int, deadline: float) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            s.settimeout(max(1e-3, deadline - time.monotonic()))
            k = s.recv_into(view[got:])
            if k == 0:
                raise _Closed
            got += k
        return bytes(buf)

    def _roundtrip(self, body: bytes) -> bytes:
        """Send one request body, return the answer's body (IndexUnavailable on no answer)."""
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(2):
            fresh = self._sock is None
            s = self._connect(deadline)
            try:
                s.settimeout(max(1e-3, deadline - time.monotonic()))
                s.sendall(frame(body))
                (n,) = struct.unpack("<I", self._recv(s, 4, deadline))
                return self._recv(s, n, deadline)
            except (_Closed, ConnectionError) as e:
                self.close()
                if fresh or attempt:  # not a stale kept connection: the index is gone
                    raise IndexUnavailable(f"the index at {self.endpoint} did not answer: {e or 'closed'}") from None
            except OSError as e:  # timeout and the rest: the connection is in an unknown state
                self.close()
                raise IndexUnavailable(
                    f"the index at {self.endpoint} did not answer within {self.timeout_ms} ms ({e or 'timed out'})"
                ) from None
        raise AssertionError("unreachable")

    def _call(self, kind: str, *args: Any) -> list[Any]:
        body = self._roundtrip(encode_request(kind, *args))
        try:
            rep = decode_request(body)
        except WireError as e:
            raise IndexRequestError(f"malformed answer from {self.endpoint}: {e}") from None
        if rep[0] == "err":
            raise IndexRequestError(str(rep[1]) if len(rep) > 1 else "error")
        return rep[1:]

    def query(self, page_hashes: Any, namespace: str = "") -> PrefixHits:
        keys = keys64(page_hashes)
        pages, pool, names, l1, l2, l3 = self._call("query", namespace, keys.astype("<u8").tobytes())
        per = {n: TierPrefix(a, b, c) for n, a, b, c in zip(names, l1, l2, l3, strict=True)}
        return PrefixHits(pages, pool, per)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = self._call("status")[0]
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> IndexClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
