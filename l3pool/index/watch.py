"""`PrefixWatch`: wakes the index's membership thread when keys under an etcd prefix change.

etcd's JSON gateway streams a watch: `POST /v3/watch` with a `create_request` answers HTTP 200
with a chunked body of one JSON object per line - `{"result": {"created": true, ...}}` first,
then one `{"result": {"events": [...]}}` per change (a put carries the key and value, a delete
`"type": "DELETE"`). `PrefixWatch` keeps one such stream per prefix on a thread of its own (its
own connection: TLS and the auth token as the `EtcdClient` it is given) and calls `changed()` on
every message that says something happened: the watch was (re)created, keys changed, the watch
was canceled or compacted. It is a trigger, not a replica: the caller re-reads the prefix (one
range) when woken, so a change made between its read and the watch's creation is never lost (the
`created` message wakes it too), and nothing depends on the stream's exact contents.

A stream that breaks (etcd restarted, the connection dropped, the token expired) is opened again
after `retry_s` (doubling to 5 s), trying the client's endpoints in turn; `live` says whether
every stream is open now, so the caller can fall back to polling meanwhile. A stream silent for
`idle_s` is reopened (a half-open TCP connection would otherwise never be noticed).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from l3pool.pool.etcd import EtcdClient, _b64, prefix_end

log = logging.getLogger(__name__)


class PrefixWatch:
    def __init__(
        self,
        etcd: EtcdClient,
        prefixes: Sequence[str],
        changed: Callable[[], None],
        *,
        retry_s: float = 0.2,
        idle_s: float = 60.0,
    ) -> None:
        self.etcd, self.prefixes, self.changed = etcd, list(prefixes), changed
        self.retry_s, self.idle_s = retry_s, idle_s
        self._stop = threading.Event()
        self._mu = threading.Lock()
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._open: set[str] = set()
        self._threads: list[threading.Thread] = []
        self.events = self.failures = self.opened = 0
        self.last_error = ""

    @property
    def live(self) -> bool:
        """Every prefix's stream is open (created) now."""
        with self._mu:
            return len(self._open) == len(self.prefixes)

    def start(self) -> PrefixWatch:
        for p in self.prefixes:
            t = threading.Thread(target=self._run, args=(p,), name=f"l3pool-index-watch{p}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self._stop.set()
        with self._mu:
            conns = list(self._conns.values())
        for c in conns:  # wakes a thread blocked in its read
            sock = c.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for t in self._threads:
            t.join(5)

    def _run(self, prefix: str) -> None:
        backoff, k = self.retry_s, 0
        while not self._stop.is_set():
            idx = (self.etcd._preferred + k) % len(self.etcd.urls)
            try:
                self._stream(prefix, idx)
                backoff = self.retry_s  # it was open: a fresh start
            except TimeoutError:  # silent for idle_s: open it again on the same endpoint
                backoff = self.retry_s
            except (OSError, http.client.HTTPException, ValueError) as e:
                if self._stop.is_set():
                    return
                self.failures += 1
                self.last_error = f"watch {prefix}: {type(e).__name__}: {e}"
                log.debug("index: %s", self.last_error)
                k += 1
            finally:
                with self._mu:
                    self._open.discard(prefix)
                    self._conns.pop(prefix, None)
            if self._stop.is_set():
                return
            self.changed()  # whatever happened while it was down: the caller re-reads
            self._stop.wait(backoff)
            backoff = min(5.0, 2 * backoff)

    def _headers(self) -> dict[str, str]:
        if self.etcd.security.auth and not self.etcd._token:
            self.etcd.authenticate()
        return self.etcd._headers()

    def _stream(self, prefix: str, idx: int) -> None:
        conn = self.etcd._new_conn(idx, self.idle_s)
        with self._mu:
            if self._stop.is_set():
                return
            self._conns[prefix] = conn
        try:
            body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}}
            conn.request("POST", "/v3/watch", json.dumps(body).encode(), self._headers())
            r = conn.getresponse()
            if r.status != 200:
                text = r.read(300).decode(errors="replace")
                if "token" in text and self.etcd.security.auth:
                    self.etcd.authenticate(stale=self.etcd._token)
                raise ValueError(f"HTTP {r.status}: {text}")
            while not self._stop.is_set():
                line = r.readline()
                if not line:
                    return  # the server ended the stream
                if not line.strip():
                    continue
                msg: dict[str, Any] = json.loads(line)
                if "error" in msg:
                    raise ValueError(f"watch error: {line[:200]!r}")
                res: dict[str, Any] = msg.get("result") or {}
                if res.get("created"):
                    with self._mu:
                        self._open.add(prefix)
                    self.opened += 1
                    self.changed()
                if res.get("events"):
                    self.events += len(res["events"])
                    self.changed()
                if res.get("canceled") or res.get("compact_revision"):
                    raise ValueError(f"watch canceled: {res.get('cancel_reason') or 'compacted'}")
        finally:
            conn.close()
