"""`IndexClient`: the global index's answers in another process (a router, a tool), over ZeroMQ.

    c = IndexClient("tcp://127.0.0.1:5757", timeout_s=1.0)
    hits = c.query(page_hashes, namespace=ns_id)     # types.PrefixHits, one round trip
    c.status()                                       # the service's status dict
    c.close()

A request that gets no answer within `timeout_s` raises `IndexUnavailable` (the socket is then
rebuilt, so the next call starts clean); an error the service answered raises `IndexRequestError`.
Not thread-safe: one client per thread. Torch-free (imports neither the index table nor l2core).
"""

from __future__ import annotations

from typing import Any

from l3pool.index.types import PrefixHits, TierPrefix
from l3pool.pool.kv_events import WireError, decode_request, encode_request, keys64


class IndexUnavailable(RuntimeError):
    """The index did not answer in time (not running, wrong endpoint, overloaded)."""


class IndexRequestError(RuntimeError):
    """The index refused the request (malformed input)."""


class IndexClient:
    def __init__(self, endpoint: str, timeout_s: float = 1.0) -> None:
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"index endpoint must look like tcp://host:port, got {endpoint!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        import zmq

        self._zmq, self.endpoint, self.timeout_ms = zmq, endpoint, max(1, int(timeout_s * 1e3))
        self._ctx = zmq.Context.instance()
        self._sock: Any = None

    def _socket(self) -> Any:
        if self._sock is None:
            zmq = self._zmq
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            try:
                s.connect(self.endpoint)
            except zmq.ZMQError as e:
                s.close()
                raise ValueError(f"bad index endpoint {self.endpoint!r}: {e}") from None
            self._sock = s
        return self._sock

    def _call(self, kind: str, *args: Any) -> list[Any]:
        zmq = self._zmq
        s = self._socket()
        try:
            s.send(encode_request(kind, *args))
            body = s.recv()
        except zmq.Again:
            self.close()  # a REQ socket that missed its reply cannot send again
            raise IndexUnavailable(f"the index at {self.endpoint} did not answer within {self.timeout_ms} ms") from None
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
