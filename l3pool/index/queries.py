"""The query path of the global index: length-prefixed msgpack requests over plain TCP.

Frame: a 4-byte little-endian body length, then the body (a msgpack request or answer of
l3pool/pool/kv_events.py: `[1, "query", namespace, keys]`, `[1, "status"]`; answers
`[1, "ok", ...]` or `[1, "err", message]`). A connection carries any number of request/answer
pairs, in order.

Why not ZeroMQ (the event side's transport): a ZeroMQ round trip passes through an I/O thread on
each side, so a query wakes six threads instead of two; on a loaded 2-core machine that tripled
the median and put the 99th percentile in the milliseconds (REQ -> ROUTER vs this, the same bytes,
500 queries/s: p50 0.10-0.12 vs 0.03-0.04 ms, p99 2.8-4.0 vs 0.06-2.4 ms). Here the kernel wakes
the serving thread directly, and the client's own thread receives the answer.

`QueryServer` serves one listening socket on a thread of its own (`selectors`, non-blocking
sockets: one thread for every connection, served in turn: one request of each per turn, see
QueryServer); `answer(body) -> body` is called on that thread.
Torch-free (the client imports `parse_endpoint` and `frame` from here).
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable

from l3pool.pool.kv_events import MAX_KEYS

log = logging.getLogger(__name__)
MAX_FRAME = 8 * MAX_KEYS + 4096  # a request of MAX_KEYS page keys and its head
MAX_UNSENT = 64 << 20  # answers a client has not read: beyond this its connection is dropped
OUT_HIGH = 1 << 20  # answers a client has not read: beyond this its requests wait (it reads first)
_LEN = struct.Struct("<I")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of `tcp://HOST:PORT` (`*` as host: every interface; port 0: any free one);
    ValueError for anything else."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise ValueError(f"index endpoint must look like tcp://host:port, got {endpoint!r}")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"index endpoint must look like tcp://host:port, got {endpoint!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return ("0.0.0.0" if host == "*" else host), int(port)


def frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


class _Conn:
    __slots__ = ("closed", "events", "inbuf", "outbuf", "queued", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.inbuf, self.outbuf = sock, bytearray(), bytearray()
        self.events = 0  # what the selector watches for it (0: not registered)
        self.queued = self.closed = False

    def has_frame(self) -> bool:
        """A whole request is buffered (its length checked against MAX_FRAME when read)."""
        return len(self.inbuf) >= 4 and len(self.inbuf) >= 4 + _LEN.unpack_from(self.inbuf)[0]


class QueryServer:
    """Listens on `endpoint` at construction (ValueError when it cannot); `start()` serves on a
    thread named `name`; `close()` stops it and closes every socket.

    Fair: each turn answers one request of every connection that has one buffered, in turn, so a
    client pipelining thousands of requests delays another client's request by one answer of
    its own, not by all of them. A connection with a whole request buffered is not read from
    until that is answered (at most one 64 KiB read beyond a request is buffered), and one with
    OUT_HIGH bytes of answers unread is neither answered nor read from until it reads them."""

    def __init__(self, endpoint: str, answer: Callable[[bytes], bytes], name: str = "l3pool-index-query") -> None:
        host, port = parse_endpoint(endpoint)
        self.answer, self.name = answer, name
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family = infos[0][0]
            ls = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            raise ValueError(f"cannot listen on {endpoint}: {e}") from None
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(infos[0][4])
            ls.listen(128)
            ls.setblocking(False)
        except OSError as e:
            ls.close()
            raise ValueError(f"cannot listen on {endpoint}: {e}") from None
        self._ls = ls
        bound = ls.getsockname()
        h = bound[0]
        self.endpoint = f"tcp://{'[' + h + ']' if ':' in h else h}:{bound[1]}"
        self._rfd, self._wfd = os.pipe()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ready: collections.deque[_Conn] = collections.deque()  # a whole request buffered, in turn
        self._conns: set[_Conn] = set()
        self.connections = self.bad_frames = self.requests = 0  # bad_frames: connections closed for one

    def start(self) -> QueryServer:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        os.write(self._wfd, b"x")
        if self._thread is not None:
            self._thread.join(5)
        if self._thread is None or not self._thread.is_alive():
            self._ls.close()
            os.close(self._rfd)
            os.close(self._wfd)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._ls, selectors.EVENT_READ, None)
        sel.register(self._rfd, selectors.EVENT_READ, "stop")
        try:
            while not self._stop:
                for key, events in sel.select(0 if self._ready else None):
                    if key.data == "stop":
                        return
                    if key.data is None:
                        self._accept(sel)
                    else:
                        self._serve(sel, key.data, events)
                self._turn(sel)
        finally:
            for c in list(self._conns):
                c.sock.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                s, _ = self._ls.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: keep serving the others
                log.warning("index: accept failed: %s", e)
                return
            s.setblocking(False)
            if s.family != socket.AF_UNIX:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = _Conn(s)
            self._conns.add(c)
            self._watch(sel, c)
            self.connections += 1

    def _drop(self, sel: selectors.BaseSelector, c: _Conn) -> None:
        if c.events:
            sel.unregister(c.sock)
        c.sock.close()
        c.closed, c.events = True, 0
        self._conns.discard(c)

    def _watch(self, sel: selectors.BaseSelector, c: _Conn) -> None:
        """Into the turn while a request is buffered and its answers are not piling up unread;
        write while answers are unsent; read unless stalled on those (`_serve` reads nothing
        while a whole request is buffered: no selector change on the way of one request)."""
        frame_in = c.has_frame()
        stalled = len(c.outbuf) >= OUT_HIGH
        want = (0 if frame_in and stalled else selectors.EVENT_READ) | (selectors.EVENT_WRITE if c.outbuf else 0)
        if want != c.events:  # never 0: a stalled connection has answers to write
            if c.events:
                sel.modify(c.sock, want, c)
            else:
                sel.register(c.sock, want, c)
            c.events = want
        if frame_in and not stalled and not c.queued:
            c.queued = True
            self._ready.append(c)

    def _serve(self, sel: selectors.BaseSelector, c: _Conn, events: int) -> None:
        """The selector's events of one connection: read what came (no answer here: `_turn`),
        send what is unsent."""
        if events & selectors.EVENT_READ and not c.has_frame():
            try:
                data = c.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""
            if data == b"":  # the client closed (or reset) the connection
                self._drop(sel, c)
                return
            if data:
                c.inbuf += data
                if len(c.inbuf) >= 4 and _LEN.unpack_from(c.inbuf)[0] > MAX_FRAME:
                    # not our protocol, or a broken client: no way to resynchronise
                    self.bad_frames += 1
                    log.debug("index: a %d-byte request frame; connection closed", _LEN.unpack_from(c.inbuf)[0])
                    self._drop(sel, c)
                    return
        if events & selectors.EVENT_WRITE and not self._flush(sel, c):
            return
        self._watch(sel, c)

    def _turn(self, sel: selectors.BaseSelector) -> None:
        """One request of each connection queued now, in turn (a connection with more buffered
        goes to the back of the queue)."""
        for _ in range(len(self._ready)):
            c = self._ready.popleft()
            c.queued = False
            if c.closed:
                continue
            n = _LEN.unpack_from(c.inbuf)[0]
            body = bytes(c.inbuf[4 : 4 + n])
            del c.inbuf[: 4 + n]
            self.requests += 1
            c.outbuf += frame(self.answer(body))
            if len(c.inbuf) >= 4 and _LEN.unpack_from(c.inbuf)[0] > MAX_FRAME:
                self.bad_frames += 1
                self._drop(sel, c)
                continue
            if self._flush(sel, c):
                self._watch(sel, c)

    def _flush(self, sel: selectors.BaseSelector, c: _Conn) -> bool:
        """Send what the socket takes of the connection's answers; False when it was dropped."""
        if not c.outbuf:
            return True
        try:
            sent = c.sock.send(c.outbuf)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(sel, c)
            return False
        del c.outbuf[:sent]
        if len(c.outbuf) > MAX_UNSENT:  # one answer larger than a client will ever read
            self._drop(sel, c)
            return False
        return True
