"""The one module that imports `mooncake`: a typed adapter over MooncakeDistributedStore.

Size: ~900 lines because it is the one module that imports `mooncake` (house rule): the client
rebuild and the dead-donor tracking live here beside the calls they guard; they are the next split
(a health module the store calls), not done yet.

Mooncake returns bare integers (0 or a byte count on success, negative codes on failure) and
prints its own logs. Here every code becomes an `Outcome`, every call takes and returns lists
of the same length (per-item results, never one bool for a batch), and a store that cannot be
reached at setup raises `StoreUnavailable` with the address in the message.

Facts this relies on (mooncake-transfer-engine 0.3.13, checked here): `put` of an existing key
returns 0 without overwriting; `batch_is_exist` returns 1/0/-1; `batch_get_into` returns the
object's size or a negative code (-704 not found, -600 destination too small);
`batch_get_into_multi_buffers` of an object whose size differs from the buffers' total answers
-800 (TRANSFER_FAIL); a pool over its high watermark answers puts with -200. `batch_put_from*`
also return 0 for a key whose object exists *or whose put another client started and never
finished* (OBJECT_ALREADY_EXISTS is turned into success; `L3Client.put` checks with `exists`
afterwards). Incomplete objects: exists 0,
get -703 (REPLICA_IS_NOT_READY), `remove(force=True)` -703 (they cannot be removed; the master
frees them after --put_start_release_timeout_sec).

Circuit breaker (`l3pool.pool.breaker.Breaker`): while the master is down Mooncake blocks every call
~4.3 s (master killed: connection refused, then RPC retries; measured on 0.3.13, a put = exists +
put 8.8 s) or 30 s (master stopped: TCP accepted, no answer), and its `health_check()` keeps
returning 0. So every call here goes through a breaker: an UNAVAILABLE answer, or a failure that
took longer than `breaker_slow_s`, opens it; a call still inside Mooncake after
`breaker_suspect_s` makes the breaker probe the master (TCP connect, then a one-key
`batch_is_exist` on its own thread with `probe_timeout_s`) and a failed probe opens it. While
open, every call answers UNAVAILABLE per item at once (microseconds) and one background probe
retries with backoff; the first successful probe closes it. Calls already inside Mooncake when
it opens cannot be interrupted: they return when Mooncake gives up. `healthy()` is the breaker's
state, refreshed by a probe when no call succeeded recently.

Rebuild: a client whose calls keep failing while its master is back is replaced. When the calls
have failed (UNAVAILABLE, or a failed probe) for `rebuild_after_s` with no success in between,
the master's port accepts TCP and its embedded HTTP metadata server answers (proof that the master
process runs; a frozen master accepts TCP but answers nothing, and Mooncake's setup against it
would hold the GIL for minutes, so nothing is set up without that proof), the probe creates a new
MooncakeDistributedStore with the same config, registers every buffer registered here again, and
swaps it in under a lock; the old client is closed on a thread of its own once no call uses it.
Counted as `rebuilds` / `rebuild_failures` in `stats()`. Donors (segment_bytes > 0, the agent)
never rebuild: a new client would mount a second segment under another name than the one the
member record in etcd names, and Mooncake's own heartbeat re-mounts a donor's segment on a
restarted master by itself (measured: ~1 s). Without an http:// metadata URL on the master's
host there is no such proof: no rebuild.

Dead donors: a get that failed with TRANSFER_FAIL (a dead donor costs ~0.1-1 s per call on 0.3.13
until the master drops its segment, 5-11 s later) marks the transfer endpoints of the failed
objects' replicas dead when the endpoint refuses a TCP connect (50 ms): the proof that nothing
listens there. Only replicas of the size asked for count (a multi-buffer get of an object of
another size also answers TRANSFER_FAIL, and that donor is fine); a live donor whose transfers
fail for another reason (a queue limit) is never marked, and neither is a SIGSTOPped one (its
kernel still accepts connections: each get pays Mooncake's transfer failure until the master
drops the segment). While any endpoint is marked, a get
first asks the master where its objects are (one `batch_get_replica_desc`, ~1 ms) and answers
MISS at once for objects whose every replica sits on a dead endpoint; the rest go to Mooncake.
A mark is re-checked every `dead_retry_s` with a TCP connect (refused: still dead; accepted: the
next get tries it for real) and forgotten after `dead_forget_s`. A failure is a miss, never data.

Frozen master: a call already inside Mooncake when the master stops answering returns only when
Mooncake's RPC deadline ends it: 30 s by default; `MC_RPC_TIMEOUT_MS` in the process environment
shortens it (`RPC_TIMEOUT_MS`, which the local cluster gives its processes; an engine sets it in its
own environment: library code never writes os.environ). Calls started after detection
(`breaker_suspect_s` + `probe_timeout_s`) answer at once.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from l2core.units import format_size
from l3pool.pool.addr import split_host_port
from l3pool.pool.breaker import Breaker
from l3pool.pool.protocols import Outcome
from l3pool.pool.transfers import TransferBudget, default_budget, fragment_chunks

log = logging.getLogger(__name__)


# Mooncake ErrorCode values (mooncake-store/include/types.h)
_CODES: dict[int, Outcome] = {
    -200: Outcome.POOL_FULL,  # NO_AVAILABLE_HANDLE
    -600: Outcome.BAD_REQUEST,  # INVALID_PARAMS
    -704: Outcome.MISS,  # OBJECT_NOT_FOUND
    -703: Outcome.MISS,  # REPLICA_IS_NOT_READY (being written by someone else)
    -706: Outcome.LEASE,  # OBJECT_HAS_LEASE
    -707: Outcome.LEASE,  # LEASE_EXPIRED
    -800: Outcome.TRANSFER_FAIL,  # TRANSFER_FAIL
    -900: Outcome.UNAVAILABLE,  # RPC_FAIL
    -101: Outcome.MISS,  # SEGMENT_NOT_FOUND (its donor left)
    -1701: Outcome.BAD_REQUEST,  # TENANT_NOT_REGISTERED (multi-tenant master: not in its policy)
}


def _exists_outcomes(codes: Sequence[int]) -> list[Outcome]:
    """batch_is_exist answers 1 (present), 0 (absent) or a negative code (unreachable)."""
    return [Outcome.OK if c == 1 else Outcome.MISS if c == 0 else Outcome.UNAVAILABLE for c in codes]


def _sized_outcomes(codes: Sequence[int], sizes: Sequence[int]) -> list[Outcome]:
    """A get answers the object's size: one that differs from the buffer is BAD_REQUEST (nothing trusted)."""
    return [Outcome.BAD_REQUEST if 0 <= c != s else outcome_of(c) for c, s in zip(codes, sizes, strict=True)]


def outcome_of(code: int) -> Outcome:
    if code >= 0:
        return Outcome.OK
    return _CODES.get(code, Outcome.ERROR)


PROTOCOLS = ("tcp", "rdma")
# Mooncake 0.3.13 refuses smaller segments at setup ("Total size must be at least 16777216", -600).
MIN_SEGMENT_BYTES = 16 << 20


def segment_too_small(nbytes: int, typed: int | str, what: str | None = "--segment-size") -> str | None:
    """The one-line refusal of a segment below Mooncake's minimum, in the units the user typed
    (None when it is big enough). Shared by the agent, `l3pool cluster up`, `l3pool deploy` and the SGLang backend."""
    if nbytes >= MIN_SEGMENT_BYTES:
        return None
    least = format_size(MIN_SEGMENT_BYTES, typed)
    alt = "" if least == "16 MiB" else " (16 MiB)"
    size = f"{what} {format_size(nbytes, typed)}" if what else format_size(nbytes, typed)
    return f"{size} is below Mooncake's minimum segment of {least}{alt}; raise {what or 'it'}"


DEFAULT_METADATA_PORT = 8080  # mooncake_master --http_metadata_server_port's default


def metadata_url(host: str, port: int = DEFAULT_METADATA_PORT) -> str:
    """The transfer-engine metadata URL served by a master started with
    --enable_http_metadata_server (IPv6 hosts bracketed). The one place that formats it."""
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{h}:{int(port)}/metadata"


class StoreError(RuntimeError):
    pass


class StoreUnavailable(StoreError):
    """The master or the metadata server could not be reached at setup."""


_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class StoreConfig:
    master: str  # host:port of mooncake_master's RPC
    metadata: str  # "P2PHANDSHAKE", "http://host:port/metadata" or "etcd://host:port"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    rdma_devices: str = ""
    segment_bytes: int = 0  # > 0: donate this much DRAM to the pool (a decode agent)
    local_buffer_bytes: int = 16 << 20
    # Mooncake's tenant id ("": its "default" tenant). Only a master started with
    # --enable_multi_tenants keeps tenants apart (list/read/remove/overwrite only their own objects);
    # without it every client shares one namespace whatever it passes (checked on 0.3.13).
    tenant: str = ""
    # circuit breaker (see the module docstring); breaker=False: every call goes to Mooncake
    breaker: bool = True
    breaker_slow_s: float = 1.0  # a failed call slower than this opens the breaker
    # a call in flight this long makes the breaker probe the master; detection of a frozen master
    # takes ~suspect + probe timeout (0.3 + 0.3 s; a healthy probe answers in ~1 ms)
    breaker_suspect_s: float = 0.3
    probe_timeout_s: float = 0.3  # a probe's batch_is_exist must answer within this (healthy: ~1 ms)
    probe_backoff_s: tuple[float, float] = (0.05, 0.5)  # first and longest wait between probes
    health_max_age_s: float = 1.0  # healthy() probes when no call succeeded for this long
    # transfer fragments in flight at once, all calls together (l3pool.pool.transfers); 0: half of
    # what Mooncake's TCP transport queues in this process (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER)
    max_transfers: int = 0
    # rebuild (module docstring): calls failing this long while the master answers -> a new client
    rebuild: bool = True  # ignored for donors (segment_bytes > 0): they never rebuild
    rebuild_after_s: float = 1.0
    # dead donors (module docstring)
    dead_retry_s: float = 2.0  # a dead mark is re-checked (TCP connect) this often
    dead_forget_s: float = 60.0  # and dropped after this long (the master has dropped the segment)

    def __post_init__(self) -> None:
        if self.tenant and not _TENANT.fullmatch(self.tenant):
            raise StoreError(f"StoreConfig.tenant {self.tenant!r}: letters, digits, '.', '_' and '-' only (max 64)")
        for name in (
            "breaker_slow_s", "breaker_suspect_s", "probe_timeout_s", "health_max_age_s", "rebuild_after_s",
            "dead_retry_s", "dead_forget_s",
        ):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise StoreError(f"StoreConfig.{name} must be a number > 0, got {v!r}")
        if isinstance(self.max_transfers, bool) or not isinstance(self.max_transfers, int) or self.max_transfers < 0:
            raise StoreError(
                f"StoreConfig.max_transfers must be an integer >= 0 (0: Mooncake's), got {self.max_transfers!r}"
            )
        lo, hi = self.probe_backoff_s
        if not 0 < lo <= hi:
            raise StoreError(f"StoreConfig.probe_backoff_s must be (first, max) with 0 < first <= max, got {lo, hi}")


# What MC_RPC_TIMEOUT_MS the local cluster gives its Mooncake processes (and engines should set):
# a call caught inside Mooncake by a frozen master returns after this instead of 30 s. Master RPCs
# are metadata only (~1 ms healthy, measured here), so 2 s leaves a wide margin.
RPC_TIMEOUT_MS = 2000
PROBE_KEY = "__l3pool_probe__"  # never stored: a probe's batch_is_exist answers 0 when the master is up
_FAILED = (Outcome.UNAVAILABLE, Outcome.ERROR)


def _check_reachable(master: str, timeout: float = 2.0) -> None:
    """Fail in seconds, with the address named, instead of Mooncake's ~90 s of setup retries."""
    try:
        host, port = split_host_port(master, "mooncake master address")
    except ValueError as e:
        raise StoreError(str(e)) from None
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise StoreUnavailable(f"mooncake master {master} unreachable: {e}") from None


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _setup_cause(rc: int, segment_bytes: int) -> str:
    """The tail of a failed setup's message: the likely cause, and where Mooncake's own log went.
    Measured on 0.3.13: a segment the host cannot allocate returns -600 after "Failed to allocate
    segment memory" in Mooncake's log (4 TiB on a 23 GiB host)."""
    from l3pool import logs

    cause = ""
    avail = _mem_available()
    if rc == -600 and avail is not None and segment_bytes > avail:
        cause = (f"; the segment ({format_size(segment_bytes)}) is larger than this host can allocate "
                 f"({format_size(avail)} available): lower --segment-size")  # fmt: skip
    where = logs.native_log()
    return cause + (f"; Mooncake's own log: {where}" if where else "; Mooncake's own log lines went to stderr")


def _connects(endpoint: str, timeout: float) -> bool:
    """A TCP connect to "host:port" succeeds within `timeout`."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError):
        return False
    return True


def _import_mooncake() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise StoreError(
            f"the mooncake package is not importable ({e}); install mooncake-transfer-engine-non-cuda "
            "(CPU hosts) or mooncake-transfer-engine (CUDA hosts) and the system library libibverbs1"
        ) from e
    return MooncakeDistributedStore


class _Client:
    """One MooncakeDistributedStore and the calls using it (a rebuilt store retires it; the last
    call out closes it)."""

    __slots__ = ("gen", "retired", "s", "users")

    def __init__(self, s: Any, gen: int) -> None:
        self.s, self.gen, self.users, self.retired = s, gen, 0, False


def _setup(cfg: StoreConfig) -> Any:
    """A new, set-up MooncakeDistributedStore of `cfg`; StoreUnavailable when setup fails."""
    s = _import_mooncake()()
    # Mooncake reads MC_* variables from the environment; we never write os.environ.
    tenant = {"tenant_id": cfg.tenant} if cfg.tenant else {}  # older wheels lack the keyword
    rc = s.setup(
        cfg.local_hostname,
        cfg.metadata,
        int(cfg.segment_bytes),
        int(cfg.local_buffer_bytes),
        cfg.protocol,
        cfg.rdma_devices,
        cfg.master,
        **tenant,
    )
    if rc != 0:
        raise StoreUnavailable(
            f"mooncake setup failed (code {rc}): master {cfg.master}, metadata {cfg.metadata}, "
            f"host {cfg.local_hostname}, protocol {cfg.protocol}"
            + (f", tenant {cfg.tenant} (is it in the master's tenant quota policy?)" if cfg.tenant else "")
            + _setup_cause(rc, int(cfg.segment_bytes))
        )
    return s


def _close_later(s: Any, what: str) -> None:
    """Close a Mooncake client on a daemon thread (its teardown may retry an unreachable master)."""

    def run() -> None:
        try:
            s.close()
        except Exception as e:  # pragma: no cover - binding errors
            log.debug("closing %s: %s", what, e)

    threading.Thread(target=run, name="l3pool-store-close", daemon=True).start()


# Placement of a put: fields of Mooncake's ReplicateConfig (replica_num, preferred_segment,
# preferred_segments, prefer_alloc_in_same_node, with_hard_pin, ...), None = the binding's default.
# Measured (bench/l3_placement.py, bench/results/2026-12-01-cpu-l3-placement.json): no field
# makes a pure client's put faster than the default, so L3Client passes none.
Placement = Mapping[str, Any] | None


def replicate_config(fields: Mapping[str, Any]) -> Any:
    """A Mooncake ReplicateConfig with `fields` set; StoreError naming an unknown field."""
    try:
        from mooncake.store import ReplicateConfig
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise StoreError(f"the mooncake package is not importable ({e})") from e
    cfg = ReplicateConfig()
    for name, value in fields.items():
        if name.startswith("_") or not hasattr(cfg, name):
            known = sorted(a for a in dir(cfg) if not a.startswith("_"))
            raise StoreError(f"ReplicateConfig has no field {name!r}; known: {known}")
        setattr(cfg, name, value)
    return cfg


class MooncakeStore:
    """One Mooncake store client (rebuilt when it keeps failing; see the module docstring).
    Thread-safe as the underlying client is."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        _check_reachable(cfg.master)
        self._c = _Client(_setup(cfg), 0)
        self._clock = threading.Lock()  # the current client, its users, the registrations
        self._registered: dict[tuple[int, int], int] = {}  # (ptr, size) -> references
        self.transfers = TransferBudget(cfg.max_transfers or default_budget())
        self._last_ok = time.monotonic()
        self._failing_since: float | None = None  # first failure (call or probe) with no call success since
        self._last_call_fail = 0.0
        self._last_probe = (True, 0.0)  # (succeeded, when)
        self._rebuild_tried = 0.0
        self._rebuild_lock = threading.Lock()
        self._counts = {"rebuilds": 0, "rebuild_failures": 0, "dead_endpoints_marked": 0, "dead_skipped_items": 0}
        self._dead: dict[str, tuple[float, float]] = {}  # endpoint -> (marked at, last checked)
        self._probe_thread: threading.Thread | None = None
        self._probe_gen = 0
        self.breaker = Breaker(
            f"mooncake master {cfg.master}",
            self._probe,
            backoff_s=cfg.probe_backoff_s,
            suspect_s=cfg.breaker_suspect_s,
            enabled=cfg.breaker,
        )
        log.info("mooncake client up: host=%s master=%s segment=%d", cfg.local_hostname, cfg.master, cfg.segment_bytes)

    @property
    def _s(self) -> Any:
        """The current MooncakeDistributedStore (tools that call the binding itself)."""
        return self._c.s

    @property
    def tenant(self) -> str:
        """Mooncake's tenant id of this client ("" = its default tenant)."""
        return self.cfg.tenant

    def register(self, ptr: int, nbytes: int) -> None:
        """Register memory for zero-copy put/get. Registering the same buffer again (several
        clients over one pool) only counts a reference; `unregister` drops one. A rebuilt client
        registers every buffer registered here again."""
        key = (int(ptr), int(nbytes))
        with self._clock:
            if key in self._registered:
                self._registered[key] += 1
                return
            rc = self._c.s.register_buffer(key[0], key[1])
            if rc != 0:
                raise StoreError(f"mooncake register_buffer(0x{ptr:x}, {nbytes}) failed with code {rc}")
            self._registered[key] = 1

    def unregister(self, ptr: int) -> None:
        with self._clock:
            for key, refs in self._registered.items():
                if key[0] == int(ptr):
                    if refs > 1:
                        self._registered[key] = refs - 1
                        return
                    del self._registered[key]
                    rc = self._c.s.unregister_buffer(key[0])
                    if rc != 0:
                        log.warning("mooncake unregister_buffer(0x%x) returned %d", ptr, rc)
                    return

    # -- the client and its rebuild ----------------------------------------------------------
    def _acquire(self) -> _Client:
        with self._clock:
            c = self._c
            c.users += 1
            return c

    def _release(self, c: _Client) -> None:
        with self._clock:
            c.users -= 1
            done = c.retired and c.users == 0
        if done:
            _close_later(c.s, f"retired mooncake client {c.gen}")

    @property
    def _may_rebuild(self) -> bool:
        return self.cfg.rebuild and self.cfg.segment_bytes == 0

    def _master_answers(self) -> bool:
        """The master process answers (not only its kernel): its embedded HTTP metadata server
        replies to a request within probe_timeout_s. False without an http:// metadata URL on
        the master's host (nothing else proves it without a Mooncake call)."""
        host = self.cfg.master.rpartition(":")[0].strip("[]")
        url = self.cfg.metadata
        if not url.startswith("http://") or urllib.parse.urlsplit(url).hostname != host:
            return False
        try:
            with urllib.request.urlopen(url + "?key=" + PROBE_KEY, timeout=self.cfg.probe_timeout_s):
                return True
        except urllib.error.HTTPError:
            return True  # an answer (e.g. 404 for the unknown key) is what we asked for
        except OSError:
            return False

    def _rebuild(self) -> bool:
        """Replace the client (see the module docstring); True when the new one is in place.
        One at a time (a concurrent caller returns False at once)."""
        if not self._rebuild_lock.acquire(blocking=False):
            return False
        try:
            return self._rebuild_locked()
        finally:
            self._rebuild_lock.release()

    def _rebuild_locked(self) -> bool:
        now = time.monotonic()
        self._rebuild_tried = now
        try:
            new = _setup(self.cfg)
        except StoreError as e:
            self._counts["rebuild_failures"] += 1
            log.warning("mooncake client rebuild failed: %s", e)
            return False
        with self._clock:
            for ptr, size in self._registered:
                rc = new.register_buffer(ptr, size)
                if rc != 0:
                    self._counts["rebuild_failures"] += 1
                    log.warning("mooncake client rebuild: register_buffer(0x%x, %d) failed with %d", ptr, size, rc)
                    _close_later(new, "a failed rebuild's client")
                    return False
            old, self._c = self._c, _Client(new, self._c.gen + 1)
            old.retired = True
            idle = old.users == 0
            self._counts["rebuilds"] += 1
        if idle:
            _close_later(old.s, f"retired mooncake client {old.gen}")
        log.warning(
            "mooncake client rebuilt (master %s answers, the old client failed for %.1f s; %d buffer(s) "
            "registered again)", self.cfg.master, now - (self._failing_since or now), len(self._registered),
        )  # fmt: skip
        return True

    # -- breaker plumbing ------------------------------------------------------------------
    def _guarded(self, n: int, name: str, *args: Any) -> tuple[Any, float, int] | None:
        """Run one Mooncake call (the client's method `name`) unless the breaker is open (then
        None: answer UNAVAILABLE): (codes, seconds, the client's generation)."""
        if not self.breaker.allow(n):
            return None
        c = self._acquire()
        t0 = time.monotonic()
        cid = self.breaker.enter()
        try:
            codes = getattr(c.s, name)(*args)
        finally:
            self.breaker.exit(cid)
            self._release(c)
        return codes, time.monotonic() - t0, c.gen

    def _batch(
        self,
        n: int,
        what: str,
        name: str,
        *args: Any,
        decode: Callable[[Sequence[int]], list[Outcome]] | None = None,
    ) -> list[Outcome]:
        """One batched Mooncake call through the breaker: per-key Outcomes (`decode` of the codes,
        default `outcome_of` each), all UNAVAILABLE when the breaker short-circuits it; the answer
        and its duration are judged (a slow or unavailable answer opens the breaker)."""
        r = self._guarded(n, name, *args)
        if r is None:
            return [Outcome.UNAVAILABLE] * n
        out = [outcome_of(c) for c in r[0]] if decode is None else decode(r[0])
        self._judge(out, r[1], what, r[2])
        return out

    def _judge(self, outs: Sequence[Outcome], took: float, what: str, gen: int) -> None:
        """Open the breaker on an UNAVAILABLE answer or a slow failure; note a healthy answer.
        A retired client's failures are not the current one's."""
        if gen != self._c.gen:
            return
        if any(o is Outcome.UNAVAILABLE for o in outs):
            self._failed(call=True)
            self.breaker.trip(f"{what}: unavailable after {took * 1e3:.0f} ms")
        elif took > self.cfg.breaker_slow_s and any(o in _FAILED for o in outs):
            self._failed(call=True)
            self.breaker.trip(f"{what}: failed after {took:.1f} s")
        elif outs:
            self._last_ok = time.monotonic()
            self._failing_since = None
            self.breaker.ok()

    def _failed(self, call: bool = False) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if call:
            self._last_call_fail = now

    def _probe(self) -> bool:
        """The master answers: TCP connect, then a one-key batch_is_exist within probe_timeout_s,
        on a thread of its own (a hung probe holds only that thread; no second one starts). A
        client failing for rebuild_after_s while its master answers is rebuilt (module docstring):
        its probe fails too and the master's HTTP server answers, or its probes keep succeeding
        while every call through it since the previous successful probe failed."""
        host, _, port = self.cfg.master.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(0.5, self.cfg.probe_timeout_s)).close()
        except OSError:
            self._failed()
            return False
        ok = self._rpc_probe()
        if ok is None:
            return False  # the previous probe is still inside Mooncake (its RPC deadline ends it)
        now = time.monotonic()
        stuck = (
            self._may_rebuild
            and self._failing_since is not None
            and now - self._failing_since >= self.cfg.rebuild_after_s
            and now - self._rebuild_tried >= self.cfg.rebuild_after_s
        )
        if stuck and (
            (ok and self._last_probe[0] and self._last_call_fail > self._last_probe[1])
            or (not ok and self._master_answers())
        ):
            if self._rebuild():
                ok = bool(self._rpc_probe())
        self._last_probe = (ok, time.monotonic())
        return ok

    def _rpc_probe(self) -> bool | None:
        """One batch_is_exist of PROBE_KEY through the current client on its own thread, within
        probe_timeout_s; None while the previous probe of this client is still inside Mooncake."""
        t = self._probe_thread
        if t is not None and t.is_alive() and self._probe_gen == self._c.gen:
            return None
        out: list[int] = []
        c = self._acquire()

        def run() -> None:
            try:
                out.extend(c.s.batch_is_exist([PROBE_KEY]))
            finally:
                self._release(c)

        self._probe_gen = c.gen
        t = self._probe_thread = threading.Thread(target=run, name="l3pool-store-probe", daemon=True)
        t.start()
        t.join(self.cfg.probe_timeout_s)
        ok = not t.is_alive() and len(out) == 1 and out[0] in (0, 1)
        if ok:
            self._last_ok = time.monotonic()
        else:
            self._failed()
        return ok

    # -- dead donors -----------------------------------------------------------------------
    def _replicas(self, keys: Sequence[str]) -> list[list[tuple[str, int]]] | None:
        """Each key's memory replicas as (transfer endpoint, object size), from one master query
        (it grants a read lease, like a get); None when the master cannot be asked."""
        try:
            r = self._guarded(len(keys), "batch_get_replica_desc", list(keys))
        except Exception as e:  # pragma: no cover - binding errors
            log.debug("batch_get_replica_desc failed: %s", e)
            return None
        if r is None:
            return None
        out = []
        for k in keys:
            reps = []
            for d in r[0].get(k, []):
                if d.is_memory_replica():
                    b = d.get_memory_descriptor().buffer_descriptor
                    reps.append((str(b.transport_endpoint), int(b.size)))
            out.append(reps)
        return out

    def _endpoints(self, keys: Sequence[str]) -> list[frozenset[str]] | None:
        """Each key's memory replicas' transfer endpoints (one master query); None when unknown."""
        reps = self._replicas(keys)
        return None if reps is None else [frozenset(ep for ep, _ in r) for r in reps]

    def _dead_now(self) -> frozenset[str]:
        """The endpoints marked dead, after re-checking those due (TCP connect, 50 ms)."""
        if not self._dead:
            return frozenset()
        now = time.monotonic()
        for ep, (marked, checked) in list(self._dead.items()):
            if now - marked > self.cfg.dead_forget_s:
                self._dead.pop(ep, None)
            elif now - checked > self.cfg.dead_retry_s:
                if _connects(ep, 0.05):
                    self._dead.pop(ep, None)
                    log.info("donor %s accepts connections again: its objects are tried again", ep)
                else:
                    self._dead[ep] = (marked, now)
        return frozenset(self._dead)

    def _mark_dead(self, keys: Sequence[str], totals: Sequence[int], took: float) -> None:
        """Mark dead the endpoints of failed gets' replicas that have the size asked for (a
        multi-buffer get of an object of another size answers TRANSFER_FAIL too: that object is
        foreign, its donor fine) when the endpoint refuses a TCP connect."""
        reps = self._replicas(keys)
        if not reps:
            return
        now = time.monotonic()
        eps = {ep for r, want in zip(reps, totals, strict=True) for ep, size in r if size == want}
        for ep in eps:
            if ep in self._dead or _connects(ep, 0.05):
                continue
            self._dead[ep] = (now, now)
            self._counts["dead_endpoints_marked"] += 1
            log.warning(
                "donor %s: transfers fail (%.2f s): its objects answer MISS until it accepts connections "
                "or the master drops it", ep, took,
            )  # fmt: skip

    def _get(
        self, keys: Sequence[str], name: str, ptrs: list[Any], sizes: list[Any], totals: Sequence[int]
    ) -> list[Outcome]:
        """A get through the breaker, skipping (MISS) objects whose replicas all sit on dead
        donors, and marking the donors of slow transfer failures dead."""
        n = len(keys)
        idx: list[int] | None = None
        dead = self._dead_now()
        if dead:
            eps = self._endpoints(keys)
            if eps is not None:
                idx = [i for i, e in enumerate(eps) if not (e and e <= dead)]
                if len(idx) == n:
                    idx = None
        if idx is None:
            sel_keys, sel_ptrs, sel_sizes, sel_totals = list(keys), ptrs, sizes, totals
        else:
            sel_keys = [keys[i] for i in idx]
            sel_ptrs, sel_sizes = [ptrs[i] for i in idx], [sizes[i] for i in idx]
            sel_totals = [totals[i] for i in idx]
            self._counts["dead_skipped_items"] += n - len(idx)
        if sel_keys:
            t0 = time.monotonic()
            got = self._batch(
                len(sel_keys), "get", name, sel_keys, sel_ptrs, sel_sizes,
                decode=lambda codes: _sized_outcomes(codes, sel_totals),
            )  # fmt: skip
            took = time.monotonic() - t0
            failed = [i for i, o in enumerate(got) if o is Outcome.TRANSFER_FAIL]
            if failed:
                self._mark_dead([sel_keys[i] for i in failed], [sel_totals[i] for i in failed], took)
        else:
            got = []
        if idx is None:
            return got
        out = [Outcome.MISS] * n
        for i, o in zip(idx, got, strict=True):
            out[i] = o
        return out

    def stats(self) -> dict[str, object]:
        """Breaker counters (state, trips, short_circuits (calls / items), probes, recoveries,
        open_s), rebuilds / rebuild_failures, dead_endpoints_marked / dead_skipped_items and
        dead_endpoints (marked now)."""
        return {**self.breaker.stats().as_dict(), **self._counts, "dead_endpoints": len(self._dead)}

    # -- data ------------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[Outcome]:
        if not keys:
            return []
        return self._batch(len(keys), "exists", "batch_is_exist", list(keys), decode=_exists_outcomes)

    def present(self, keys: list[str]) -> np.ndarray:
        """`exists` as a bool array (True: present), without building per-key Outcomes; like
        `exists` it grants every present object a read lease. Takes a list (passed through).
        Unreachable (or breaker open): all False."""
        if not keys:
            return np.zeros(0, dtype=np.bool_)
        r = self._guarded(len(keys), "batch_is_exist", keys)
        if r is None:
            return np.zeros(len(keys), dtype=np.bool_)
        codes = np.asarray(r[0])
        self._judge([Outcome.UNAVAILABLE if (codes < 0).any() else Outcome.OK], r[1], "exists", r[2])
        return codes == 1

    @property
    def max_transfers(self) -> int:
        """Fragments this client may have in flight at once (a call is cut to fit)."""
        return self.transfers.limit

    def _moved(
        self,
        what: str,
        name: str,
        keys: list[str],
        ptrs: list[Any],
        sizes: list[Any],
        counts: Sequence[int],
        totals: Sequence[int] | None = None,
        extra: tuple[Any, ...] = (),
    ) -> list[Outcome]:
        """A call that moves bytes (Mooncake method `name`), cut into parts of at most
        `max_transfers` fragments (each object `counts[i]`), each part holding its fragments of
        the budget while in Mooncake. `totals`: a get, with the object sizes it expects (another
        size is BAD_REQUEST; objects on dead donors are skipped, see `_get`). `extra`: more
        arguments of a put's every part (its ReplicateConfig)."""
        out: list[Outcome] = []
        for lo, hi in fragment_chunks(counts, self.transfers.limit):
            with self.transfers.hold(int(sum(counts[lo:hi]))):
                if totals is None:
                    out += self._batch(hi - lo, what, name, keys[lo:hi], ptrs[lo:hi], sizes[lo:hi], *extra)
                else:
                    out += self._get(keys[lo:hi], name, ptrs[lo:hi], sizes[lo:hi], totals[lo:hi])
        return out

    def put(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], replicate: Placement = None
    ) -> list[Outcome]:
        """One object per key from one buffer; `replicate`: placement (`replicate_config`)."""
        if not keys:
            return []
        extra = (replicate_config(replicate),) if replicate is not None else ()
        return self._moved("put", "batch_put_from", list(keys), list(ptrs), list(sizes), [1] * len(keys), extra=extra)

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[Outcome]:
        """Copy each object into its buffer; a size mismatch is BAD_REQUEST (nothing trusted)."""
        if not keys:
            return []
        n = len(keys)
        return self._moved("get", "batch_get_into", list(keys), list(ptrs), list(sizes), [1] * n, list(sizes))

    def put_multi(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        replicate: Placement = None,
    ) -> list[Outcome]:
        """One object per key from several fragments (e.g. a layer_first page's per-layer runs, or
        a page and its trailer); `replicate`: placement (`replicate_config`)."""
        if not keys:
            return []
        frags, lens = [list(p) for p in ptrs], [list(s) for s in sizes]
        counts = [len(f) for f in frags]
        extra = (replicate_config(replicate),) if replicate is not None else ()
        return self._moved("put", "batch_put_from_multi_buffers", list(keys), frags, lens, counts, extra=extra)

    def get_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[Outcome]:
        if not keys:
            return []
        frags, lens = [list(p) for p in ptrs], [list(s) for s in sizes]
        counts, totals = [len(f) for f in frags], [sum(s) for s in lens]
        return self._moved("get", "batch_get_into_multi_buffers", list(keys), frags, lens, counts, totals)

    def unfinished(self, keys: Sequence[str]) -> list[bool | None]:
        """Per key: True while another put of it has started and not finished (its writer may be
        dead), False when there is no object at all (never stored, evicted, removed), None when
        unknown (unreachable, or complete by now). `exists` answers 0 for both of the first two;
        Mooncake's get_size tells them apart (measured on 0.3.13: -703 REPLICA_IS_NOT_READY for an
        abandoned put, -704 OBJECT_NOT_FOUND for an absent key). One RPC per key: a failure path
        only (a put that said OK for a key that is not complete right after)."""
        out: list[bool | None] = []
        for k in keys:
            r = self._guarded(1, "get_size", k)
            code = None if r is None else int(r[0])
            out.append(True if code == -703 else False if code == -704 else None)
        return out

    def object_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Each key's object size from its first complete memory replica (one master query for
        the batch; like a get it grants a read lease); None where it has none (absent,
        incomplete, unreachable)."""
        if not keys:
            return []
        try:
            r = self._guarded(len(keys), "batch_get_replica_desc", list(keys))
        except Exception as e:  # pragma: no cover - binding errors
            log.debug("batch_get_replica_desc failed: %s", e)
            return [None] * len(keys)
        if r is None:
            return [None] * len(keys)
        desc = r[0]
        out: list[int | None] = []
        for k in keys:
            size = None
            for r in desc.get(k, []):
                if r.is_memory_replica():
                    size = int(r.get_memory_descriptor().buffer_descriptor.size)
                    break
            out.append(size)
        return out

    def remove(self, key: str, force: bool = False) -> Outcome:
        """Remove one object. Without `force` an object under a read lease (any exists/get in the
        last --default_kv_lease_ttl, including `L3Client.put`'s check of what it wrote) answers
        LEASE; `force` skips the lease and replication checks."""
        r = self._guarded(1, "remove", key, bool(force))
        if r is None:
            return Outcome.UNAVAILABLE
        out = outcome_of(r[0])
        self._judge([out], r[1], "remove", r[2])
        return out

    def remove_prefix(self, prefix: str, force: bool = False) -> tuple[Outcome, int]:
        """Remove every object whose key starts with `prefix`: (OK, objects removed) or (failure, 0).

        One master RPC (`remove_by_regex`; 0.3.13 searches the key with the regex, so it is anchored
        here and the prefix escaped). Without `force` the master skips objects under a read lease
        (any `exists`/get in the last `--default_kv_lease_ttl`, 10 s by default) and objects being
        replicated: measured here, 0 of 4 objects removed right after a lookup, all 4 with force.
        `force` also takes objects another client may be reading right now."""
        if not prefix:
            raise ValueError("remove_prefix needs a non-empty prefix (use a namespace id + '/')")
        pattern = "^" + re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", prefix)
        code = int(self._s.remove_by_regex(pattern, bool(force)))
        if code < 0:
            log.warning("mooncake remove_by_regex(%r) returned %d", pattern, code)
            return outcome_of(code), 0
        return Outcome.OK, code

    def healthy(self) -> bool:
        """Whether the master answers now: False while the breaker is open; when no call
        succeeded within `health_max_age_s`, a probe decides (bounded by ~probe_timeout_s + 0.5 s).
        Mooncake's own health_check() is not used: it stays 0 while the master is down."""
        if not self.cfg.breaker:
            return bool(self._probe())
        if self.breaker.is_open:
            return False
        if time.monotonic() - self._last_ok < self.cfg.health_max_age_s and self.breaker.oldest_call_s() < (
            self.cfg.breaker_suspect_s
        ):
            return True
        return self.breaker.probe()

    @property
    def segment_name(self) -> str:
        """This client's name at the master ("host:port"): its donated segment's name in the
        master's /get_all_segments and /query_segment (one host can run several clients)."""
        return str(self._s.get_hostname())

    def close(self) -> None:
        self.breaker.close()
        with self._clock:
            s = self._c.s
            for ptr, _ in list(self._registered):
                try:
                    s.unregister_buffer(ptr)
                except Exception as e:
                    log.debug("unregister_buffer(0x%x): %s", ptr, e)
            self._registered.clear()
        s.close()
