"""The one module that speaks to etcd: a small synchronous client over etcd's v3 JSON gateway.

Why not `etcd3`: its last release (0.12, 2020) fails to import with current protobuf unless the
whole process is forced onto pure-Python protobuf, which would slow every other protobuf user in
an inference engine. `aetcd` is asyncio-only and `etcd3gw` pulls in pbr/futurist/debtcollector and
`requests`. What we need is small — range, put, delete, one-compare transactions, leases — and the
JSON gateway that every etcd >= 3.4 serves on its client port gives exactly that over HTTP/1.1.
This client keeps one persistent connection per thread (no handshake per call), tries the
configured endpoints in order, and turns every transport problem into `EtcdUnavailable` with the
endpoint named, so callers never see a socket traceback.

Fail fast: after a call found no endpoint answering, a circuit breaker (`l3pool.pool.breaker`) opens
and every later call raises `EtcdUnavailable` at once (microseconds, instead of up to `timeout`
per endpoint and call while etcd hangs) until a background probe (a fresh connection and
/v3/maintenance/status within `probe_timeout`) sees an endpoint answer again; the probe retries
after 50 ms, doubling up to 0.5 s. Lease keep-alives from `LeaseKeeper`'s own thread bypass the
breaker (their thread may block; the lease's TTL decides, as before).
"""

from __future__ import annotations

import base64
import email.utils
import http.client
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from l3pool.metrics import LEASE_RENEWAL_FAILURES, LEASE_RENEWALS
from l3pool.pool.breaker import Breaker

log = logging.getLogger(__name__)


class EtcdError(RuntimeError):
    """etcd answered with an error."""


class EtcdUnavailable(EtcdError):
    """No configured etcd endpoint could be reached."""


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    lease: int
    mod_revision: int
    create_revision: int


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prefix_end(prefix: str) -> bytes:
    """The range end (raw bytes: it need not be valid UTF-8) selecting every key starting with `prefix`."""
    b = bytearray(prefix.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


# -- transaction parts (the only place that writes etcd's txn JSON) --------------------------
def if_lease(key: str, lease: int) -> dict[str, Any]:
    """Compare: `key` is attached to `lease`."""
    return {"key": _b64(key), "target": "LEASE", "result": "EQUAL", "lease": str(int(lease))}


def if_absent(key: str) -> dict[str, Any]:
    """Compare: `key` does not exist."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def do_put(key: str, value: bytes | str, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(int(lease))
    return {"request_put": put}


def do_delete(key: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key)}}


def do_count_prefix(prefix: str) -> dict[str, Any]:
    return {"request_range": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "count_only": True}}


def txn_succeeded(out: dict[str, Any]) -> bool:
    return bool(out.get("succeeded"))


def txn_count(out: dict[str, Any], i: int) -> int:
    """The count answered by the i-th operation (a `do_count_prefix`) of the branch that ran."""
    return int(out["responses"][i]["response_range"].get("count", 0))


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """'http://127.0.0.1:2379,127.0.0.2:2379' -> [(host, port), ...]; raises ValueError."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for raw in items:
        e = raw.strip()
        if not e:
            continue
        try:
            u = urlsplit(e if "://" in e else f"http://{e}")
        except ValueError as err:
            raise ValueError(f"bad etcd endpoint {raw!r}: {err}") from None
        if u.scheme != "http" or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f"bad etcd endpoint {raw!r}: expected host:port or http://host:port")
        try:
            port = u.port or 2379
        except ValueError:
            raise ValueError(f"bad etcd endpoint {raw!r}: port is not a number") from None
        out.append((u.hostname, port))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


class EtcdClient:
    """Thread-safe; each thread uses its own keep-alive connection."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        timeout: float = 2.0,
        *,
        fail_fast: bool = True,
        probe_timeout: float = 0.5,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self.probe_timeout = probe_timeout
        self._local = threading.local()
        self._preferred = 0
        names = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        self.breaker = Breaker(f"etcd {names}", self._probe, backoff_s=(0.05, 0.5), enabled=fail_fast)

    # -- transport -----------------------------------------------------------------------
    def _conn(self, idx: int) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        c = conns.get(idx)
        if c is None:
            host, port = self.endpoints[idx]
            c = conns[idx] = http.client.HTTPConnection(host, port, timeout=self.timeout)
        return c

    def _drop(self, idx: int) -> None:
        conns = getattr(self._local, "conns", {})
        c = conns.pop(idx, None)
        if c is not None:
            c.close()

    def call(self, path: str, body: dict[str, Any], *, bypass: bool = False) -> dict[str, Any]:
        """POST one request. `bypass`: leave the breaker out (call even while it is open; a
        failure does not open it)."""
        if bypass:
            return self._call(path, body)
        if not self.breaker.allow():
            raise EtcdUnavailable(f"etcd unreachable (failing fast since: {self.breaker.last_reason})")
        try:
            out = self._call(path, body)
        except EtcdUnavailable as e:
            self.breaker.trip(str(e)[:300])
            raise
        self.breaker.ok()
        return out

    def _probe(self) -> bool:
        """Any endpoint answers /v3/maintenance/status within probe_timeout (own connection)."""
        for host, port in self.endpoints:
            c = http.client.HTTPConnection(host, port, timeout=self.probe_timeout)
            try:
                c.request("POST", "/v3/maintenance/status", b"{}", {"Content-Type": "application/json"})
                if c.getresponse().status == 200:
                    return True
            except (OSError, http.client.HTTPException):
                pass
            finally:
                c.close()
        return False

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload = json.dumps(body).encode()  # bytes: headers and body leave in one segment
        errors = []
        n = len(self.endpoints)
        for k in range(n):
            idx = (self._preferred + k) % n
            for attempt in range(2):  # a kept-alive connection may have been closed by the server
                c = self._conn(idx)
                try:
                    c.request("POST", path, payload, {"Content-Type": "application/json"})
                    r = c.getresponse()
                    data = r.read()
                except (OSError, http.client.HTTPException) as e:
                    self._drop(idx)
                    if attempt == 0 and isinstance(
                        e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
                    ):
                        continue
                    errors.append(f"{self.endpoints[idx][0]}:{self.endpoints[idx][1]}: {e or type(e).__name__}")
                    break
                self._preferred = idx
                try:
                    out = json.loads(data) if data else {}
                except json.JSONDecodeError:
                    raise EtcdError(f"etcd {path}: HTTP {r.status}, not JSON: {data[:200]!r}") from None
                if r.status != 200:
                    msg = out.get("message") or out.get("error") or data[:200].decode(errors="replace")
                    raise EtcdError(f"etcd {path}: HTTP {r.status}: {msg}")
                return out  # type: ignore[no-any-return]
        raise EtcdUnavailable("etcd unreachable: " + "; ".join(errors))

    # -- KV ------------------------------------------------------------------------------
    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("/v3/kv/put", body)["header"]["revision"])

    def get(self, key: str) -> KV | None:
        kvs = self._range({"key": _b64(key)})
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str, keys_only: bool = False) -> list[KV]:
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        if keys_only:
            body["keys_only"] = True
        return self._range(body)

    def count_prefix(self, prefix: str) -> int:
        out = self.call(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "count_only": True}
        )
        return int(out.get("count", 0))

    def _range(self, body: dict[str, Any]) -> list[KV]:
        out = self.call("/v3/kv/range", body)
        return [_kv(x) for x in out.get("kvs", [])]

    def delete(self, key: str) -> int:
        return int(self.call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def delete_prefix(self, prefix: str) -> int:
        out = self.call("/v3/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return int(out.get("deleted", 0))

    def put_if_absent(self, key: str, value: bytes | str, lease: int = 0) -> tuple[bool, KV | None]:
        """Create `key` only if it does not exist. Returns (created, existing KV if not created)."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        out = self.call(
            "/v3/kv/txn",
            {
                "compare": [{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": _b64(key)}}],
            },
        )
        if out.get("succeeded"):
            return True, None
        kvs = out["responses"][0]["response_range"].get("kvs", [])
        return False, (_kv(kvs[0]) if kvs else None)

    def txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """A transaction; build its parts with the `if_*` / `do_*` helpers of this module (plain
        strings in, the gateway's base64 wire format out). Returns the gateway's answer: read it with
        `txn_succeeded` / `txn_count`."""
        return self.call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def delete_if_lease(self, key: str, lease: int) -> bool:
        """Delete `key` only while it is attached to `lease` (a successor's record survives)."""
        return txn_succeeded(self.txn([if_lease(key, lease)], [do_delete(key)]))

    # -- leases --------------------------------------------------------------------------
    def lease_grant(self, ttl: int) -> int:
        return int(self.call("/v3/lease/grant", {"TTL": str(int(ttl)), "ID": "0"})["ID"])

    def lease_keepalive(self, lease: int, *, bypass: bool = False) -> int:
        """Refresh a lease; returns the TTL left (<= 0: the lease is gone). `bypass`: see `call`."""
        out = self.call("/v3/lease/keepalive", {"ID": str(lease)}, bypass=bypass)
        return int(out.get("result", {}).get("TTL", 0))

    def lease_ttl(self, lease: int) -> int:
        """Seconds left on a lease, -1 when it does not exist."""
        out = self.call("/v3/lease/timetolive", {"ID": str(lease)})
        return int(out.get("TTL", -1))

    def lease_revoke(self, lease: int) -> None:
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    def status(self, *, bypass: bool = False) -> dict[str, Any]:
        return self.call("/v3/maintenance/status", {}, bypass=bypass)

    def date_sample(self, clock: Callable[[], float] = time.time) -> tuple[float, float, float, str]:
        """One `GET /version` on the preferred endpoint: (local clock before, local clock after,
        the server's HTTP Date header in unix seconds, etcd's server version). The Date header has
        1 s resolution; callers bound the clock offset by sampling across its second boundaries."""
        idx = self._preferred
        host, port = self.endpoints[idx]
        for attempt in range(2):
            c = self._conn(idx)
            t0 = clock()
            try:
                c.request("GET", "/version")
                r = c.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException) as e:
                self._drop(idx)
                if attempt == 0 and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError)):
                    continue
                raise EtcdUnavailable(f"etcd unreachable: {host}:{port}: {e or type(e).__name__}") from None
            t1 = clock()
            date = r.getheader("Date")
            if r.status != 200 or not date:
                raise EtcdError(f"etcd /version: HTTP {r.status}, Date header {date!r}")
            try:
                version = str(json.loads(data).get("etcdserver", "?"))
            except (json.JSONDecodeError, AttributeError):
                version = "?"
            return t0, t1, email.utils.parsedate_to_datetime(date).timestamp(), version
        raise EtcdUnavailable(f"etcd unreachable: {host}:{port}")  # pragma: no cover - loop returns or raises

    def close(self) -> None:
        """Close this thread's connections and stop the breaker's probe (later calls still work)."""
        self.breaker.close()
        for idx in list(getattr(self._local, "conns", {})):
            self._drop(idx)


def _kv(x: dict[str, Any]) -> KV:
    return KV(
        key=_unb64(x["key"]).decode(),
        value=_unb64(x.get("value", "")),
        lease=int(x.get("lease", 0)),
        mod_revision=int(x.get("mod_revision", 0)),
        create_revision=int(x.get("create_revision", 0)),
    )


class LeaseKeeper:
    """Keeps one lease alive from a background thread (refresh every ttl/3).

    `lost` is set when the lease expired or etcd stayed unreachable past the TTL; the owner
    decides what that means (an agent re-registers, a lock holder gives up). Keep-alives are
    counted in `l3pool_lease_renewals_total{owner}` / `l3pool_lease_renewal_failures_total{owner}`
    (`owner` one of a few fixed words: member, stats, other).
    """

    def __init__(self, client: EtcdClient, ttl: int, owner: str = "other") -> None:
        self.client, self.ttl = client, ttl
        self._renewed, self._failed = LEASE_RENEWALS(owner), LEASE_RENEWAL_FAILURES(owner)
        self.lease = client.lease_grant(ttl)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(max(0.2, self.ttl / 3)):
            try:
                if self.client.lease_keepalive(self.lease, bypass=True) <= 0:
                    self._failed.inc()
                    log.warning("etcd lease %x expired", self.lease)
                    self.lost.set()
                    return
                self._renewed.inc()
                last_ok = time.monotonic()
            except EtcdError as e:
                self._failed.inc()
                if "not found" in str(e) and not isinstance(e, EtcdUnavailable):  # etcd lost it (wiped)
                    log.warning("etcd lease %x is gone: %s", self.lease, e)
                    self.lost.set()
                    return
                if time.monotonic() - last_ok > self.ttl:
                    log.warning("etcd lease %x lost: %s", self.lease, e)
                    self.lost.set()
                    return

    def close(self, revoke: bool = True) -> None:
        self._stop.set()
        self._thread.join()
        if revoke and not self.lost.is_set():
            try:
                self.client.lease_revoke(self.lease)
            except EtcdError as e:
                log.warning("could not revoke etcd lease %x: %s", self.lease, e)
