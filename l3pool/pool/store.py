"""A typed adapter over MooncakeDistributedStore: per-item `Outcome`s, a circuit breaker, dead
donors skipped (gets) and steered around (puts).

Split by role: `connection.py` is the one module that imports `mooncake` (setup, registrations,
the client rebuild), `donors.py` tracks dead and live donors, `breaker.py` the breaker; this module
is the store's calls and what decides around them.

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

Rebuild: a client whose calls keep failing while its master answers is replaced by a new one with
every buffer registered again (`connection.py`); the probe below decides when. Donors never rebuild.

Dead donors (`donors.py`): a get or put that failed with TRANSFER_FAIL marks the donors whose
transfer engines refuse a TCP connect (their RPC address from the metadata server); while one is
marked, gets answer its objects MISS at once and puts go to a live donor (Mooncake's
`preferred_segment`). A failure is a miss, never data; a put is OK only when Mooncake stored it.

Deadlines (`call_deadline_s`, default 40 ms): the metadata calls an engine waits on (`exists`,
`present`, `replicas`, `unfinished`) run on the store's call threads and the caller waits at most
the deadline (plus 20 us per key); with the thread hand-off (~1 ms) a call costs under 50 ms
whatever the master does. An overdue call answers UNAVAILABLE for its keys at once (a lookup: a
miss) and makes the breaker probe the master now, within the same deadline (`Breaker.suspect`):
a failed probe opens it (~2 deadlines after the freeze), and later calls answer at once. A
healthy master answers in ~1 ms; a host that deschedules the call's thread past the deadline
costs that one call a miss and one probe, never wrong data. The call itself stays inside Mooncake until it returns,
on its thread; a call that was still queued when its caller gave up is never sent. These calls
write no caller memory, so abandoning them is safe. Calls that move bytes (get, put) are not
abandoned here: Mooncake may still write or read the caller's registered buffers; the prefetcher
leaves such a batch behind and quarantines its pages (`l3pool.pool.prefetch`), using `answers()`
to tell a hung master from a slow transfer.

Frozen master: a call already inside Mooncake when the master stops answering returns only when
Mooncake's RPC deadline ends it: 30 s by default; `MC_RPC_TIMEOUT_MS` in the process environment
shortens it (`RPC_TIMEOUT_MS`, which the local cluster gives its processes; an engine sets it in its
own environment: library code never writes os.environ). Calls started after detection
(`breaker_suspect_s` + `probe_timeout_s`) answer at once.
"""

from __future__ import annotations

import functools
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from l2core.units import format_size
from l3pool import metrics
from l3pool.pool.breaker import Breaker
from l3pool.pool.connection import (
    PROBE_KEY,
    Connection,
    StoreClosed,
    StoreError,
    StoreUnavailable,
    mem_available,
    replicate_config,
)
from l3pool.pool.donors import DeadDonors
from l3pool.pool.protocols import Outcome
from l3pool.pool.transfers import TransferBudget, default_budget, fragment_chunks

__all__ = [
    "MooncakeStore", "Outcome", "Placement", "StoreClosed", "StoreConfig", "StoreError", "StoreUnavailable",
    "replicate_config",
]  # fmt: skip

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
_RDMA_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_rdma_devices(text: str, protocol: str, what: str = "--rdma-devices", sys_root: str | None = "/") -> str:
    """The RDMA device list as Mooncake takes it ("mlx5_0,mlx5_1"; "" lets Mooncake pick), normalised.
    ValueError naming `what` (none when "": the caller names the key) when a name is malformed,
    devices are given with protocol tcp (Mooncake would ignore them), or, `sys_root` given, a named
    device is not under its /sys/class/infiniband."""
    names = [n.strip() for n in text.split(",")] if text.strip() else []
    given = f"{what} {text!r}".lstrip()
    if bad := [n for n in names if not _RDMA_DEVICE.fullmatch(n)]:
        which = "" if bad == [text.strip()] else f" {', '.join(map(repr, bad))}"  # the whole text: named once
        raise ValueError(f"{given}:{which} not an RDMA device name (e.g. mlx5_0)")
    if names and protocol != "rdma":
        raise ValueError(f"{given} with protocol {protocol!r}: RDMA devices are for protocol 'rdma'")
    if names and sys_root is not None:
        base = Path(sys_root, "sys/class/infiniband")
        present = sorted(p.name for p in base.iterdir()) if base.is_dir() else []
        if missing := [n for n in names if n not in present]:
            raise ValueError(f"{what}: no RDMA device {', '.join(missing)} on this host "
                             f"(present: {', '.join(present) or 'none'})")  # fmt: skip
    return ",".join(names)


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


def segment_too_large(nbytes: int, typed: int | str, what: str = "--segment-size", agents: int = 1) -> str | None:
    """The one-line refusal of `agents` segments of `nbytes` that this host cannot back now (None
    when they fit in `mem_available()`, or when that cannot be read). Where the kernel overcommits
    (vm.overcommit_memory=1, as on the GPU host), Mooncake's setup mounts even a 4 TiB segment on
    a 128 GiB host; the pool then places pages in memory that does not exist, and the first writes
    bring the OOM killer. Checked by the agent on the host that donates, and by `l3pool cluster up`
    for all its agents together, before Mooncake sees the size."""
    avail = mem_available()
    if avail is None or nbytes * agents <= avail:
        return None
    size = format_size(nbytes, typed)
    if agents == 1:
        return f"{what} {size} is larger than this host's available memory ({format_size(avail)}): lower {what}"
    return (f"{agents} agents x {what} {size} = {format_size(nbytes * agents, typed)} is more than this host's "
            f"available memory ({format_size(avail)}): lower --agents or {what}")  # fmt: skip


DEFAULT_METADATA_PORT = 8080  # mooncake_master --http_metadata_server_port's default


def metadata_url(host: str, port: int = DEFAULT_METADATA_PORT) -> str:
    """The transfer-engine metadata URL served by a master started with
    --enable_http_metadata_server (IPv6 hosts bracketed). The one place that formats it."""
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{h}:{int(port)}/metadata"


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
    # the longest an engine waits for a metadata call (module docstring "Deadlines"); None: no deadline
    call_deadline_s: float | None = 0.04

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
        d = self.call_deadline_s
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 60):
            raise StoreError(f"StoreConfig.call_deadline_s must be a number of seconds in (0, 60] or None, got {d!r}")
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
_FAILED = (Outcome.UNAVAILABLE, Outcome.ERROR)


# Placement of a put: fields of Mooncake's ReplicateConfig (replica_num, preferred_segment,
# preferred_segments, prefer_alloc_in_same_node, with_hard_pin, ...), None = the binding's default.
# Measured (bench/l3_placement.py, bench/results/2026-12-0{1,2}-cpu-l3-placement.json, group_ids and
# a one-fragment object included): no field makes a pure client's put faster than the default, so
# L3Client passes none; `_put` passes preferred_segment only while a donor is marked dead.
Placement = Mapping[str, Any] | None

# a deadline's allowance per key (batch_is_exist: 1.6-2.2 us per key on the 16-core host, measured)
_DEADLINE_PER_KEY_S = 20e-6
# threads that run calls under a deadline: one hung call holds one; when all are held the queued
# calls pass their deadlines (UNAVAILABLE) and the breaker is open by then
_DEADLINE_THREADS = 8

# keys of recent successful puts (a sample of each call's) kept to find the donors after a put's transfers fail
_RECENT_KEYS, _RECENT_PER_CALL = 64, 16


class MooncakeStore:
    """One Mooncake store client (rebuilt when it keeps failing; see the module docstring).
    Thread-safe as the underlying client is."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.conn = Connection(cfg)
        self.transfers = TransferBudget(cfg.max_transfers or default_budget())
        self.donors = DeadDonors(cfg.dead_retry_s, cfg.dead_forget_s, cfg.metadata)
        self._recent: list[str] = []  # keys recent put calls stored (a sample of each)
        self._last_ok = time.monotonic()
        self._probe_thread: threading.Thread | None = None
        self._probe_gen = 0
        self.breaker = Breaker(
            f"mooncake master {cfg.master}",
            self._probe,
            backoff_s=cfg.probe_backoff_s,
            suspect_s=cfg.breaker_suspect_s,
            enabled=cfg.breaker,
        )
        metrics.watch_breaker(self.breaker, "mooncake")
        self._close_lock = threading.Lock()
        self._closed = False
        self._call_pool: ThreadPoolExecutor | None = None  # made on the first call under a deadline
        self._pool_lock = threading.Lock()
        self.overdue_calls = 0  # calls whose caller stopped waiting at the deadline
        log.info("mooncake client %s up: host=%s master=%s segment=%d", self.conn.current.name, cfg.local_hostname,
                 cfg.master, cfg.segment_bytes)  # fmt: skip

    @property
    def _s(self) -> Any:
        """The current MooncakeDistributedStore (tools that call the binding itself); StoreClosed
        after close()."""
        if self.conn.closed:
            raise StoreClosed(f"mooncake client {self.conn.current.name} is closed")
        return self.conn.current.s

    @property
    def tenant(self) -> str:
        """Mooncake's tenant id of this client ("" = its default tenant)."""
        return self.cfg.tenant

    def register(self, ptr: int, nbytes: int) -> None:
        """Register memory for zero-copy put/get (reference-counted; `Connection.register`)."""
        self.conn.register(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        self.conn.unregister(ptr)

    # -- breaker plumbing ------------------------------------------------------------------
    def _guarded(self, n: int, name: str, *args: Any, bounded: bool = False) -> tuple[Any, float, int] | None:
        """Run one Mooncake call (the client's method `name`) unless the breaker is open (then
        None: answer UNAVAILABLE): (codes, seconds, the client's generation). `bounded`: a call
        that writes no caller memory, waited for at most the deadline (module docstring); None
        when it is overdue."""
        if not self.breaker.allow(n):
            return None
        if not bounded or self.cfg.call_deadline_s is None:
            return self._call(name, args)
        return self._within(self.cfg.call_deadline_s + n * _DEADLINE_PER_KEY_S, name, args, f"{name} of {n} keys")

    def _within(self, limit: float, name: str, args: tuple[Any, ...], what: str) -> tuple[Any, float, int] | None:
        """`_call` on a call thread, waited for at most `limit` s; None when overdue (counted, and
        the breaker probes now)."""
        given_up = threading.Event()
        fut = self._calls().submit(self._call, name, args, given_up)
        try:
            return fut.result(limit)
        except FutureTimeout:
            given_up.set()
            with self._pool_lock:
                self.overdue_calls += 1
            bounded_probe = functools.partial(self._probe, min(limit, self.cfg.probe_timeout_s))
            self.breaker.suspect(f"{what} had no answer within {limit * 1e3:.0f} ms", bounded_probe)
            return None

    def _calls(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._call_pool is None:
                self._call_pool = ThreadPoolExecutor(_DEADLINE_THREADS, thread_name_prefix="l3pool-store-call")
            return self._call_pool

    def _call(
        self, name: str, args: tuple[Any, ...], given_up: threading.Event | None = None
    ) -> tuple[Any, float, int] | None:
        if given_up is not None and given_up.is_set():
            return None  # queued behind hung calls until its caller gave up: never sent
        c = self.conn.acquire()
        t0 = time.monotonic()
        cid = self.breaker.enter()
        try:
            codes = getattr(c.s, name)(*args)
        finally:
            self.breaker.exit(cid)
            self.conn.release(c)
        return codes, time.monotonic() - t0, c.gen

    def _batch(
        self,
        n: int,
        what: str,
        name: str,
        *args: Any,
        decode: Callable[[Sequence[int]], list[Outcome]] | None = None,
        bounded: bool = False,
    ) -> list[Outcome]:
        """One batched Mooncake call through the breaker: per-key Outcomes (`decode` of the codes,
        default `outcome_of` each), all UNAVAILABLE when the breaker short-circuits it; the answer
        and its duration are judged (a slow or unavailable answer opens the breaker)."""
        r = self._guarded(n, name, *args, bounded=bounded)
        if r is None:
            return [Outcome.UNAVAILABLE] * n
        out = [outcome_of(c) for c in r[0]] if decode is None else decode(r[0])
        self._judge(out, r[1], what, r[2])
        return out

    def _judge(self, outs: Sequence[Outcome], took: float, what: str, gen: int) -> None:
        """Open the breaker on an UNAVAILABLE answer or a slow failure; note a healthy answer.
        A retired client's failures are not the current one's."""
        if gen != self.conn.current.gen:
            return
        if any(o is Outcome.UNAVAILABLE for o in outs):
            self.conn.failed(call=True)
            self.breaker.trip(f"{what}: unavailable after {took * 1e3:.0f} ms")
        elif took > self.cfg.breaker_slow_s and any(o in _FAILED for o in outs):
            self.conn.failed(call=True)
            self.breaker.trip(f"{what}: failed after {took:.1f} s")
        elif outs:
            self._last_ok = time.monotonic()
            self.conn.succeeded()
            self.breaker.ok()

    def _probe(self, timeout_s: float | None = None) -> bool:
        """The master answers: TCP connect, then a one-key batch_is_exist within `timeout_s`
        (default probe_timeout_s; an overdue call's probe: its own deadline),
        on a thread of its own (a hung probe holds only that thread; no second one starts). A
        client failing for rebuild_after_s while its master answers is rebuilt
        (`Connection.stuck`). False once closed."""
        if self.conn.closed:
            return False
        host, _, port = self.cfg.master.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(0.5, self.cfg.probe_timeout_s)).close()
        except OSError:
            self.conn.failed()
            return False
        ok = self._rpc_probe(timeout_s)
        if ok is None:
            return False  # the previous probe is still inside Mooncake (its RPC deadline ends it)
        if self.conn.stuck(ok) and self.conn.rebuild():
            ok = bool(self._rpc_probe(timeout_s))
        self.conn.last_probe = (ok, time.monotonic())
        return ok

    def _rpc_probe(self, timeout_s: float | None = None) -> bool | None:
        """One batch_is_exist of PROBE_KEY through the current client on its own thread, within
        probe_timeout_s; None while the previous probe of this client is still inside Mooncake."""
        t = self._probe_thread
        if t is not None and t.is_alive() and self._probe_gen == self.conn.current.gen:
            return None
        out: list[int] = []
        c = self.conn.acquire()

        def run() -> None:
            try:
                out.extend(c.s.batch_is_exist([PROBE_KEY]))
            finally:
                self.conn.release(c)

        self._probe_gen = c.gen
        t = self._probe_thread = threading.Thread(target=run, name="l3pool-store-probe", daemon=True)
        t.start()
        t.join(self.cfg.probe_timeout_s if timeout_s is None else timeout_s)
        ok = not t.is_alive() and len(out) == 1 and out[0] in (0, 1)
        if ok:
            self._last_ok = time.monotonic()
        else:
            self.conn.failed()
        return ok

    # -- where objects are, and dead donors ------------------------------------------------------
    def replicas(self, keys: Sequence[str]) -> list[list[tuple[str, int]]] | None:
        """Each key's memory replicas as (transfer endpoint, object size), from one master query
        (it grants a read lease, like a get); None when the master cannot be asked. The
        endpoints seen are remembered (`DeadDonors.saw`)."""
        if not keys:
            return []
        try:
            r = self._guarded(len(keys), "batch_get_replica_desc", list(keys), bounded=True)
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
        self.donors.saw(ep for reps in out for ep, _ in reps)
        return out

    def replica_endpoints(self, keys: Sequence[str]) -> list[frozenset[str]] | None:
        """Each key's memory replicas' transfer endpoints (one master query); None when unknown."""
        reps = self.replicas(keys)
        return None if reps is None else [frozenset(ep for ep, _ in r) for r in reps]

    def _get(
        self, keys: Sequence[str], name: str, ptrs: list[Any], sizes: list[Any], totals: Sequence[int]
    ) -> list[Outcome]:
        """A get through the breaker, skipping (MISS) objects whose replicas all sit on dead
        donors, and marking the donors of transfer failures dead (`donors.py`)."""
        n = len(keys)
        idx: list[int] | None = None
        dead = self.donors.dead_now()
        if dead:
            eps = self.replica_endpoints(keys)
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
            self.donors.skipped(n - len(idx))
        if sel_keys:
            t0 = time.monotonic()
            got = self._batch(
                len(sel_keys), "get", name, sel_keys, sel_ptrs, sel_sizes,
                decode=lambda codes: _sized_outcomes(codes, sel_totals),
            )  # fmt: skip
            took = time.monotonic() - t0
            failed = [i for i, o in enumerate(got) if o is Outcome.TRANSFER_FAIL]
            if failed:
                # only replicas of the size asked for count: a multi-buffer get of an object of
                # another size also answers TRANSFER_FAIL, and that donor is fine
                reps = self.replicas([sel_keys[i] for i in failed])
                want = [sel_totals[i] for i in failed]
                if reps:
                    on = [ep for r, w in zip(reps, want, strict=True) for ep, size in r if size == w]
                    self.donors.mark(on, took, "get")
        else:
            got = []
        if idx is None:
            return got
        out = [Outcome.MISS] * n
        for i, o in zip(idx, got, strict=True):
            out[i] = o
        return out

    def _put(
        self, keys: list[str], name: str, ptrs: list[Any], sizes: list[Any], replicate: Placement
    ) -> list[Outcome]:
        """A put through the breaker. Without a placement of its own it goes to a live donor
        while any donor is marked dead (`DeadDonors.steer`); after a transfer failure the donors
        of recent puts' objects that refuse a TCP connect are marked dead."""
        steer = None if replicate is not None else self.donors.steer()
        place = {"preferred_segment": steer} if steer is not None else replicate
        extra = (replicate_config(place),) if place is not None else ()
        t0 = time.monotonic()
        out = self._batch(len(keys), "put", name, keys, ptrs, sizes, *extra)
        stored = [k for k, o in zip(keys, out, strict=True) if o is Outcome.OK]
        if stored:  # a sample of what this call stored, to find the donors later
            sample = stored[:: max(1, len(stored) // _RECENT_PER_CALL)][:_RECENT_PER_CALL]
            self._recent = [*self._recent, *sample][-_RECENT_KEYS:]
        if Outcome.TRANSFER_FAIL in out and self._recent:
            took = time.monotonic() - t0
            reps = self.replicas(self._recent)
            if reps is not None:
                self.donors.mark(self.donors.seen(), took, "put")
        return out

    def stats(self) -> dict[str, object]:
        """Breaker counters (state, trips, short_circuits (calls / items), probes, recoveries,
        open_s), rebuilds / rebuild_failures, dead_endpoints_marked / dead_skipped_items /
        steered_puts, dead_endpoints (marked now) and overdue_calls (past their deadline)."""
        return {
            **self.breaker.stats().as_dict(), **self.conn.counts, **self.donors.counts,
            "dead_endpoints": len(self.donors), "overdue_calls": self.overdue_calls,
        }  # fmt: skip

    # -- data ------------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[Outcome]:
        if not keys:
            return []
        return self._batch(len(keys), "exists", "batch_is_exist", list(keys), decode=_exists_outcomes, bounded=True)

    def present(self, keys: list[str]) -> np.ndarray:
        """`exists` as a bool array (True: present), without building per-key Outcomes; like
        `exists` it grants every present object a read lease. Takes a list (passed through).
        Unreachable (or breaker open): all False."""
        if not keys:
            return np.zeros(0, dtype=np.bool_)
        r = self._guarded(len(keys), "batch_is_exist", keys, bounded=True)
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
        name: str,
        keys: list[str],
        ptrs: list[Any],
        sizes: list[Any],
        counts: Sequence[int],
        totals: Sequence[int] | None = None,
        replicate: Placement = None,
    ) -> list[Outcome]:
        """A call that moves bytes (Mooncake method `name`), cut into parts of at most
        `max_transfers` fragments (each object `counts[i]`), each part holding its fragments of
        the budget while in Mooncake. `totals`: a get, with the object sizes it expects (another
        size is BAD_REQUEST; objects on dead donors are skipped, see `_get`); else a put with its
        placement (`_put`)."""
        out: list[Outcome] = []
        for lo, hi in fragment_chunks(counts, self.transfers.limit):
            with self.transfers.hold(int(sum(counts[lo:hi]))):
                if totals is None:
                    out += self._put(keys[lo:hi], name, ptrs[lo:hi], sizes[lo:hi], replicate)
                else:
                    out += self._get(keys[lo:hi], name, ptrs[lo:hi], sizes[lo:hi], totals[lo:hi])
        return out

    def put(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], replicate: Placement = None
    ) -> list[Outcome]:
        """One object per key from one buffer; `replicate`: placement (`replicate_config`)."""
        if not keys:
            return []
        return self._moved("batch_put_from", list(keys), list(ptrs), list(sizes), [1] * len(keys), replicate=replicate)

    def get(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[Outcome]:
        """Copy each object into its buffer; a size mismatch is BAD_REQUEST (nothing trusted)."""
        if not keys:
            return []
        n = len(keys)
        return self._moved("batch_get_into", list(keys), list(ptrs), list(sizes), [1] * n, list(sizes))

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
        return self._moved("batch_put_from_multi_buffers", list(keys), frags, lens, counts, replicate=replicate)

    def get_multi(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[Outcome]:
        if not keys:
            return []
        frags, lens = [list(p) for p in ptrs], [list(s) for s in sizes]
        counts, totals = [len(f) for f in frags], [sum(s) for s in lens]
        return self._moved("batch_get_into_multi_buffers", list(keys), frags, lens, counts, totals)

    def unfinished(self, keys: Sequence[str]) -> list[bool | None]:
        """Per key: True while another put of it has started and not finished (its writer may be
        dead), False when there is no object at all (never stored, evicted, removed), None when
        unknown (unreachable, or complete by now). `exists` answers 0 for both of the first two;
        Mooncake's get_size tells them apart (measured on 0.3.13: -703 REPLICA_IS_NOT_READY for an
        abandoned put, -704 OBJECT_NOT_FOUND for an absent key). One RPC per key: a failure path
        only (a put that said OK for a key that is not complete right after)."""
        out: list[bool | None] = []
        for k in keys:
            r = self._guarded(1, "get_size", k, bounded=True)
            code = None if r is None else int(r[0])
            out.append(True if code == -703 else False if code == -704 else None)
        return out

    def object_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Each key's object size from its first complete memory replica (one master query for
        the batch; like a get it grants a read lease); None where it has none (absent,
        incomplete, unreachable)."""
        if not keys:
            return []
        reps = self.replicas(keys)
        if reps is None:
            return [None] * len(keys)
        return [r[0][1] if r else None for r in reps]

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
        Mooncake's own health_check() is not used: it stays 0 while the master is down. False once closed."""
        if self.conn.closed:
            return False
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
    def call_deadline_s(self) -> float | None:
        """`StoreConfig.call_deadline_s`: the longest a caller waits for a metadata call."""
        return self.cfg.call_deadline_s

    def answers(self, deadline_s: float | None = None) -> bool:
        """Whether the master answers a one-key lookup within `deadline_s` (default
        `call_deadline_s`, else `probe_timeout_s`) now; False at once while the breaker is open or
        the client is closed. For waiters of calls that move bytes, which cannot be abandoned: it
        tells a hung master (overdue: the breaker probes) from a slow transfer (~1 ms healthy)."""
        if self.conn.closed or (self.cfg.breaker and self.breaker.is_open):
            return False
        limit = deadline_s or self.cfg.call_deadline_s or self.cfg.probe_timeout_s
        r = self._within(limit, "batch_is_exist", ([PROBE_KEY],), "a one-key lookup")
        if r is None or len(r[0]) != 1 or r[0][0] not in (0, 1):
            return False
        self._last_ok = time.monotonic()
        return True

    @property
    def segment_name(self) -> str:
        """This client's name at the master ("host:port"): its donated segment's name in the
        master's /get_all_segments and /query_segment (one host can run several clients)."""
        return self.conn.current.name  # read at setup: the binding's get_hostname() crashes after close

    def close(self) -> None:
        """Close the Mooncake client: its buffers unregistered, its segment (a donor's) unmounted,
        its records removed from the metadata server. Idempotent and thread-safe; an owner closes
        what it opened (a client left open is closed at exit, with a warning: connection.py)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        metrics.unwatch_breaker(self.breaker)
        self.breaker.close()
        with self._pool_lock:
            calls, self._call_pool = self._call_pool, None
        if calls is not None:  # calls still inside Mooncake end with it (conn.close waits for them)
            calls.shutdown(wait=False, cancel_futures=True)
        name, t0 = self.conn.current.name, time.monotonic()
        self.conn.close()
        log.info("mooncake client %s closed in %.2f s", name, time.monotonic() - t0)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
