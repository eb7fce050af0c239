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

Security (`EtcdSecurity`): `https://` endpoints (or scheme-less ones when TLS files are given) use
TLS with the given CA file (else the system's trust store) and, for etcd's `--client-cert-auth`,
a client certificate and key. With a user, the client authenticates once
(`/v3/auth/authenticate`), sends the token in the `Authorization` header of every request (the
breaker's probe and lease keep-alives included) and, when etcd answers that the token is invalid
or expired, authenticates again once and retries. TLS and auth failures are `EtcdAuthError`: a
configuration problem, reported with the endpoint and a hint, never retried and never counted as
etcd being down. `add_security_args` / `security_from_args` are the command-line side every tool
shares (a password comes from a file or `L3POOL_ETCD_PASSWORD`, never from a flag).
"""

from __future__ import annotations

import argparse
import base64
import email.utils
import http.client
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from l3pool.metrics import LEASE_RENEWAL_FAILURES, LEASE_RENEWALS, unwatch_breaker, watch_breaker
from l3pool.pool.addr import check_host
from l3pool.pool.breaker import Breaker

log = logging.getLogger(__name__)


class EtcdError(RuntimeError):
    """etcd answered with an error."""


class EtcdUnavailable(EtcdError):
    """No configured etcd endpoint could be reached."""


class EtcdAuthError(EtcdError):
    """etcd refused us: TLS handshake/verification failed, wrong user or password, no permission,
    or plain HTTP spoken to a TLS port. A configuration problem: the message names the endpoint
    and carries a hint."""


PASSWORD_ENV = "L3POOL_ETCD_PASSWORD"


@dataclass(frozen=True)
class EtcdSecurity:
    """How to reach a secured etcd: TLS files and/or a user with a password. Every field is
    optional; the default is plain HTTP without auth. Files are checked to exist at construction
    (ValueError naming the file)."""

    ca_file: str | None = None  # CA bundle that signed etcd's server certificate (default: system trust)
    cert_file: str | None = None  # client certificate, for etcd's --client-cert-auth
    key_file: str | None = None  # its private key
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"etcd {name.replace('_', ' ')} {path}: no such file")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("etcd client TLS needs both a certificate and its key (got only one)")
        if self.user is not None and not self.user:
            raise ValueError("etcd user must not be empty")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd auth needs both a user and a password (got only one)")

    @property
    def tls(self) -> bool:
        """TLS material given: scheme-less endpoints then use https."""
        return self.ca_file is not None or self.cert_file is not None

    @property
    def auth(self) -> bool:
        return self.user is not None

    def ssl_context(self) -> ssl.SSLContext:
        """A client context verifying etcd's certificate (and hostname) against ca_file."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file is not None:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as e:
            files = ", ".join(str(f) for f in (self.ca_file, self.cert_file, self.key_file) if f)
            raise ValueError(f"etcd TLS files ({files}) are not usable: {e}") from None
        return ctx

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], what: str = "etcd security") -> EtcdSecurity:
        """From a config dict with keys ca, cert, key, user, password_file (see `security_mapping`).
        With a user, the password is read from password_file, else from the environment's
        L3POOL_ETCD_PASSWORD: config files and command lines never hold it."""
        vals: dict[str, str | None] = dict(security_mapping(d, what))
        password = _password(vals.get("user"), None, vals.get("password_file"), os.environ, what)
        return cls(vals.get("ca"), vals.get("cert"), vals.get("key"), vals.get("user"), password)


SECURITY_KEYS = ("ca", "cert", "key", "user", "password_file")


def security_mapping(d: Mapping[str, Any], what: str = "etcd security") -> dict[str, str]:
    """The set keys of a config dict of etcd security settings (paths + user; absent or "" = not
    set), checked for unknown keys and types only — no file is touched (a config may be parsed on
    another machine than the one that connects). ValueError with a one-line reason."""
    unknown = sorted(set(d) - set(SECURITY_KEYS))
    if unknown:
        hint = " (put the password in a file: password_file)" if "password" in unknown else ""
        raise ValueError(f"{what}: unknown key(s) {', '.join(unknown)}; known: {', '.join(SECURITY_KEYS)}{hint}")
    out = {}
    for k in SECURITY_KEYS:
        v = d.get(k)
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{what}: {k} must be a string, got {type(v).__name__}")
        if v:
            out[k] = v
    return out


def _password(
    user: str | None, password: str | None, password_file: str | None, env: Mapping[str, str], what: str
) -> str | None:
    if password is not None and password_file is not None:
        raise ValueError(f"{what}: give the etcd password once (a file or the environment), not both")
    if password_file is not None:
        try:
            password = Path(password_file).read_text().rstrip("\r\n")
        except OSError as e:
            raise ValueError(f"etcd password file {password_file}: {e.strerror or e}") from None
    if password is None and user is not None:
        password = env.get(PASSWORD_ENV)
        if password is None:
            raise ValueError(f"etcd user {user!r} needs a password: --etcd-password-file FILE or env {PASSWORD_ENV}")
    if password is not None and user is None:
        raise ValueError("an etcd password was given without a user (--etcd-user)")
    return password


class _RefusePassword(argparse.Action):
    """`--etcd-password X` is refused without echoing X (argparse would otherwise take it as an
    abbreviation of --etcd-password-file and print the password in its error)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.error(
            f"--etcd-password: a password on the command line is visible to every local user; "
            f"use --etcd-password-file FILE or env {PASSWORD_ENV}"
        )


def add_security_args(p: argparse.ArgumentParser) -> None:
    """The etcd TLS/auth flags every tool takes (each also read from an L3POOL_ETCD_* variable)."""
    g = p.add_argument_group("etcd security (TLS and auth)")
    g.add_argument("--etcd-ca", metavar="FILE", help="CA certificate(s) that signed etcd's (env L3POOL_ETCD_CA)")
    g.add_argument("--etcd-cert", metavar="FILE", help="client certificate for etcd (env L3POOL_ETCD_CERT)")
    g.add_argument("--etcd-key", metavar="FILE", help="the client certificate's key (env L3POOL_ETCD_KEY)")
    g.add_argument("--etcd-user", metavar="NAME", help="etcd user (env L3POOL_ETCD_USER)")
    g.add_argument(
        "--etcd-password-file",
        metavar="FILE",
        help=f"file holding the etcd user's password (or env {PASSWORD_ENV}; never on the command line)",
    )
    g.add_argument("--etcd-password", action=_RefusePassword, help=argparse.SUPPRESS)


def security_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> EtcdSecurity:
    """The flags of `add_security_args` (falling back to L3POOL_ETCD_CA/_CERT/_KEY/_USER and
    L3POOL_ETCD_PASSWORD[_FILE]) as one `EtcdSecurity`; ValueError with a one-line reason."""
    env = os.environ if env is None else env

    def pick(attr: str, var: str) -> str | None:
        return getattr(args, attr, None) or env.get(var) or None

    user = pick("etcd_user", "L3POOL_ETCD_USER")
    pw_file = pick("etcd_password_file", "L3POOL_ETCD_PASSWORD_FILE")
    password = _password(user, None, pw_file, env, "etcd security")
    return EtcdSecurity(
        pick("etcd_ca", "L3POOL_ETCD_CA"), pick("etcd_cert", "L3POOL_ETCD_CERT"), pick("etcd_key", "L3POOL_ETCD_KEY"),
        user, password,
    )  # fmt: skip


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


class Endpoint(NamedTuple):
    scheme: str  # "http" | "https"; "" when the endpoint gave none (the security settings decide)
    host: str
    port: int

    @property
    def name(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme or 'http'}://{h}:{self.port}"


def parse_urls(endpoints: str | Sequence[str]) -> list[Endpoint]:
    """'https://10.0.0.1:2379,10.0.0.2:2379' -> [Endpoint, ...]; raises ValueError."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for raw in items:
        e = raw.strip()
        if not e:
            continue
        try:
            u = urlsplit(e if "://" in e else f"none://{e}")
        except ValueError as err:
            raise ValueError(f"bad etcd endpoint {raw!r}: {err}") from None
        if u.scheme not in ("http", "https", "none") or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f"bad etcd endpoint {raw!r}: expected host:port, http://host:port or https://host:port")
        try:
            port = u.port or 2379
        except ValueError:
            raise ValueError(f"bad etcd endpoint {raw!r}: port is not a number") from None
        check_host(u.hostname, f"bad etcd endpoint {raw!r}: host")
        out.append(Endpoint("" if u.scheme == "none" else u.scheme, u.hostname, port))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """'http://127.0.0.1:2379,127.0.0.2:2379' -> [(host, port), ...]; raises ValueError."""
    return [(e.host, e.port) for e in parse_urls(endpoints)]


def resolve_endpoints(endpoints: str | Sequence[str], security: EtcdSecurity) -> list[Endpoint]:
    """Endpoints with their scheme decided: https when given or when TLS files are set. An
    explicit http:// next to TLS files is refused (it would silently send the traffic in clear)."""
    out = []
    for e in parse_urls(endpoints):
        if e.scheme == "http" and security.tls:
            raise ValueError(f"etcd endpoint {e.name}: http:// with TLS files given; use https://{e.host}:{e.port}")
        out.append(e._replace(scheme=e.scheme or ("https" if security.tls else "http")))
    return out


def check_settings(endpoints: str | Sequence[str], security: EtcdSecurity) -> list[Endpoint]:
    """Everything about endpoints + security that can be wrong before connecting (schemes, the
    TLS files' contents); ValueError with a one-line reason."""
    urls = resolve_endpoints(endpoints, security)
    if any(e.scheme == "https" for e in urls):
        security.ssl_context()
    return urls


_HTTP_TO_TLS = b"HTTP request to an HTTPS server"
_AUTH_MESSAGES = (
    "CommonName of client",
    "authentication failed",
    "user name is empty",
    "user name not found",
    "permission denied",
    "invalid auth token",
    "authentication is not enabled",
)
_TOKEN_EXPIRED = ("invalid auth token", "auth token is expired")


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """A TLS handshake (no verification, nothing sent after it) with host:port succeeds: used
    only to explain why a plain-HTTP request was dropped."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, ctx.wrap_socket(raw):
            return True
    except (OSError, ssl.SSLError):
        return False


def _auth_hint(msg: str, security: EtcdSecurity | None = None) -> str:
    m = msg.lower()
    if security is not None and not security.auth and ("permission denied" in m or "user name is empty" in m):
        return "etcd has auth enabled: give --etcd-user and a password"
    if "commonname of client" in m:
        return "with auth on, etcd's JSON gateway refuses client certificates that carry a CN: issue one without"
    if "eof occurred" in m and security is not None and security.cert_file is None:
        return "etcd closed the TLS connection: it probably requires a client certificate (--etcd-cert/--etcd-key)"
    if "certificate_required" in m or "certificate required" in m or "bad certificate" in m:
        return "etcd wants a client certificate it trusts: --etcd-cert/--etcd-key"
    if "certificate verify failed" in m:
        return "etcd's certificate is not signed by the CA given: --etcd-ca (and its SAN must name the host)"
    if "wrong_version_number" in m or "wrong version number" in m or "record layer failure" in m:
        return "this endpoint does not speak TLS: use http:// (or enable TLS on etcd)"
    if "authentication failed" in m or "user name not found" in m:
        return "check --etcd-user and the password (--etcd-password-file / L3POOL_ETCD_PASSWORD)"
    if "user name is empty" in m or "invalid auth token" in m:
        return "etcd has auth enabled: give --etcd-user and a password"
    if "permission denied" in m:
        return "the etcd user lacks a role with read/write on the key prefix"
    if "authentication is not enabled" in m:
        return "etcd has auth disabled: leave out --etcd-user"
    return "check the etcd TLS/auth settings"


class EtcdClient:
    """Thread-safe; each thread uses its own keep-alive connection. `security`: TLS files and/or
    a user (see `EtcdSecurity`); ValueError at construction for endpoints or files that cannot work."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        timeout: float = 2.0,
        *,
        fail_fast: bool = True,
        probe_timeout: float = 0.5,
        security: EtcdSecurity | None = None,
    ) -> None:
        self.security = security or EtcdSecurity()
        self.urls = resolve_endpoints(endpoints, self.security)
        self.endpoints = [(e.host, e.port) for e in self.urls]
        self._ssl = self.security.ssl_context() if any(e.scheme == "https" for e in self.urls) else None
        self.timeout = timeout
        self.probe_timeout = probe_timeout
        self._local = threading.local()
        self._preferred = 0
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        names = ",".join(e.name for e in self.urls)
        self.breaker = Breaker(f"etcd {names}", self._probe, backoff_s=(0.05, 0.5), enabled=fail_fast)
        watch_breaker(self.breaker, "etcd")

    # -- transport -----------------------------------------------------------------------
    def _new_conn(self, idx: int, timeout: float) -> http.client.HTTPConnection:
        e = self.urls[idx]
        if e.scheme == "https":
            return http.client.HTTPSConnection(e.host, e.port, timeout=timeout, context=self._ssl)
        return http.client.HTTPConnection(e.host, e.port, timeout=timeout)

    def _conn(self, idx: int) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        c = conns.get(idx)
        if c is None:
            c = conns[idx] = self._new_conn(idx, self.timeout)
        return c

    def _drop(self, idx: int) -> None:
        conns = getattr(self._local, "conns", {})
        c = conns.pop(idx, None)
        if c is not None:
            c.close()

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self._token:
            h["Authorization"] = self._token
        return h

    def call(self, path: str, body: dict[str, Any], *, bypass: bool = False) -> dict[str, Any]:
        """POST one request. `bypass`: leave the breaker out (call even while it is open; a
        failure does not open it)."""
        if bypass:
            return self._authed_call(path, body)
        if not self.breaker.allow():
            raise EtcdUnavailable(f"etcd unreachable (failing fast since: {self.breaker.last_reason})")
        try:
            out = self._authed_call(path, body)
        except EtcdUnavailable as e:
            self.breaker.trip(str(e)[:300])
            raise
        self.breaker.ok()
        return out

    def _authed_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """`_call` with a token when a user is configured: authenticate first if there is no
        token yet; when etcd calls the token invalid (expired, or etcd restarted), authenticate
        again once and retry."""
        if not self.security.auth:
            return self._call(path, body)
        token = self._token or self.authenticate()
        try:
            return self._call(path, body)
        except EtcdAuthError as e:
            if not any(m in str(e) for m in _TOKEN_EXPIRED):
                raise
            self.authenticate(stale=token)
            return self._call(path, body)

    def authenticate(self, stale: str | None = None) -> str:
        """Get a fresh token (one thread at a time; a thread that finds another already replaced
        `stale` reuses that token)."""
        with self._auth_lock:
            if self._token is not None and self._token != stale:
                return self._token
            self._token = None
            out = self._call("/v3/auth/authenticate", {"name": self.security.user, "password": self.security.password})
            token = out.get("token")
            if not token:
                raise EtcdAuthError(f"etcd {self.urls[self._preferred].name}: authenticate answered no token")
            self._token = str(token)
            return self._token

    def _probe(self) -> bool:
        """Any endpoint answers /v3/maintenance/status within probe_timeout (own connection)."""
        for idx in range(len(self.urls)):
            c = self._new_conn(idx, self.probe_timeout)
            try:
                c.request("POST", "/v3/maintenance/status", b"{}", self._headers())
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
        n = len(self.urls)
        for k in range(n):
            idx = (self._preferred + k) % n
            name = self.urls[idx].name
            for attempt in range(2):  # a kept-alive connection may have been closed by the server
                c = self._conn(idx)
                try:
                    c.request("POST", path, payload, self._headers())
                    r = c.getresponse()
                    data = r.read()
                except ssl.SSLError as e:
                    self._drop(idx)
                    if isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError)) and attempt == 0:
                        continue
                    msg = f"etcd {name}: TLS failed: {e.reason or e}"
                    raise EtcdAuthError(f"{msg} -> {_auth_hint(str(e), self.security)}") from None
                except (OSError, http.client.HTTPException) as e:
                    self._drop(idx)
                    dropped = isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError))
                    if attempt == 0 and dropped:
                        continue
                    e_ = self.urls[idx]
                    if dropped and e_.scheme == "http" and _speaks_tls(e_.host, e_.port, self.timeout):
                        raise EtcdAuthError(
                            f"etcd {name}: the server speaks TLS, not plain HTTP -> use https://{e_.host}:{e_.port} "
                            "and --etcd-ca (plus --etcd-cert/--etcd-key if it checks client certificates)"
                        ) from None
                    errors.append(f"{name.split('://')[-1]}: {e or type(e).__name__}")
                    break
                self._preferred = idx
                if r.status == 400 and _HTTP_TO_TLS in data:
                    raise EtcdAuthError(f"etcd {name}: the server speaks TLS -> use https:// and --etcd-ca")
                try:
                    out = json.loads(data) if data else {}
                except json.JSONDecodeError:
                    if b"CommonName of client" in data:
                        msg = data.decode(errors="replace").strip()
                        raise EtcdAuthError(f"etcd {name}: {msg} -> {_auth_hint(msg)}") from None
                    raise EtcdError(f"etcd {path}: HTTP {r.status}, not JSON: {data[:200]!r}") from None
                if r.status != 200:
                    msg = str(out.get("message") or out.get("error") or data[:200].decode(errors="replace"))
                    if any(m in msg for m in _AUTH_MESSAGES):
                        raise EtcdAuthError(f"etcd {name}: {msg.strip()} -> {_auth_hint(msg, self.security)}")
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
            if "lease not found" not in str(e) or isinstance(e, EtcdAuthError):
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
            except ssl.SSLError as e:
                self._drop(idx)
                raise EtcdAuthError(
                    f"etcd {self.urls[idx].name}: TLS failed: {e} -> {_auth_hint(str(e), self.security)}"
                ) from None
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
        unwatch_breaker(self.breaker)
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
                if "lease not found" in str(e) and not isinstance(e, (EtcdUnavailable, EtcdAuthError)):  # wiped
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
