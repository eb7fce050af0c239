"""Every Prometheus metric l3pool exports, and the helper that serves them.

One home: modules that count something import the metric objects from here; nothing else
creates a metric. Names follow Prometheus conventions (`l3pool_` prefix, `_total` counters,
`_bytes_total` byte counters, `_seconds` histograms, plain names for gauges). Labels take values
from small fixed sets only (operation, outcome, tier, owner, engine): never keys, namespaces,
request ids or member ids, so a scrape stays the same size however long the process runs.

Metrics live in `prometheus_client`'s default registry, so they are per process: every
L3Client (or cache) of a process adds to the same series. Counters only grow; a test or a
report reads the difference between two scrapes.

Cost (measured, see l3pool/README.md "Metrics"): a batch call updates a handful of counters
and one histogram, whatever its page count, so a 512-page get pays a few microseconds.

    from l3pool.metrics import serve
    server = serve(9464, "127.0.0.1")      # MetricsError (one line) when the port is unusable
    ...
    server.shutdown()

Import-light (prometheus_client is pure Python): the agent imports this without torch. Where
prometheus_client is missing (an interpreter outside the install, e.g. a bare python3 running
`l3pool cluster status`) every metric is inert and `serve()` says so; nothing else changes.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

try:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

    AVAILABLE = True
except ImportError:  # an interpreter without it (the H200 host has it: checked 2026-12-01)
    AVAILABLE = False

    class _Inert:
        """Stands in for a metric when prometheus_client is missing: every update is a no-op."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def labels(self, *labels: str) -> _Inert:
            return self

        def inc(self, amount: float = 1) -> None:
            pass

        def set(self, value: float) -> None:
            pass

        def observe(self, value: float) -> None:
            pass

    Counter = Gauge = Histogram = _Inert  # type: ignore[assignment,misc]
    REGISTRY = None  # type: ignore[assignment]

# batch calls (one Mooncake round trip for up to batch_pages pages) on loopback TCP take 0.2-50 ms;
# a master outage makes them take seconds (the breaker then answers in microseconds)
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# lock waits and cache waits (a PP stage waiting for stage 0, a load waiting for its prefetch)
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Children:
    """Label children of one metric, looked up once per label tuple (prometheus_client's
    `labels()` validates its arguments on every call; this is a dict lookup)."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> Any:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self._metric.labels(*labels)
        return child


# -- node agent ----------------------------------------------------------------------------------
AGENT_DONATED_BYTES = Gauge("l3pool_agent_donated_bytes", "DRAM this agent donates to the pool (its Mooncake segment)")
AGENT_REGISTERED = Gauge("l3pool_agent_registered", "1 while the agent's member key is registered in etcd, else 0")
AGENT_MOONCAKE_HEALTHY = Gauge("l3pool_agent_mooncake_healthy", "1 while its Mooncake client reaches the master")
AGENT_REREGISTRATIONS = Counter(
    "l3pool_agent_reregistrations_total", "Times the agent registered again (lease lost, key missing)"
)

_agent_used: Gauge | None = None


def agent_used_bytes() -> Gauge:
    """l3pool_agent_used_bytes, made on first use: an agent without --master-admin cannot know
    its used bytes, and a gauge that always said 0 would mislead."""
    global _agent_used
    if _agent_used is None:
        _agent_used = Gauge(
            "l3pool_agent_used_bytes",
            "Bytes of this agent's segment holding objects, as the master's /query_segment reports them",
        )
    return _agent_used


# -- etcd leases (pool/etcd.py LeaseKeeper) --------------------------------------------------------
_LEASE_RENEWALS = Counter(
    "l3pool_lease_renewals_total", "Successful etcd lease keep-alives", ["owner"]
)  # owner: member (an agent's registration), stats (an L3Client's published counters), other
_LEASE_RENEWAL_FAILURES = Counter(
    "l3pool_lease_renewal_failures_total", "etcd lease keep-alives that failed (etcd down or lease gone)", ["owner"]
)
LEASE_RENEWALS = _Children(_LEASE_RENEWALS)
LEASE_RENEWAL_FAILURES = _Children(_LEASE_RENEWAL_FAILURES)

# -- L3Client (pool/client.py) -------------------------------------------------------------------
_CLIENT_PAGES = Counter(
    "l3pool_client_pages_total",
    "Pages per operation (get, put, exists) and outcome (an Outcome value; put splits OK into ok = stored "
    "and skipped = already present)",
    ["op", "outcome"],
)
_CLIENT_BYTES = Counter(
    "l3pool_client_bytes_total", "Page bytes moved: get = copied into L2 and verified, put = stored", ["op"]
)
_CLIENT_BATCH_SECONDS = Histogram(
    "l3pool_client_batch_seconds",
    "Latency of one batch call (up to batch_pages pages) per operation",
    ["op"],
    buckets=LATENCY_BUCKETS,
)
CLIENT_LOOKUPS = Counter("l3pool_client_lookups_total", "lookup() calls (longest present prefix)")
CLIENT_LOOKUP_HIT_PAGES = Counter("l3pool_client_lookup_hit_pages_total", "Pages in the prefixes lookup() found")
CLIENT_TRAILER_REJECTIONS = Counter(
    "l3pool_client_trailer_rejections_total", "Objects whose trailer or size did not bind them to their key (misses)"
)
CLIENT_CHECKSUM_FAILURES = Counter(
    "l3pool_client_checksum_failures_total", "Objects whose page bytes did not match their checksum (misses)"
)
CLIENT_PAGES = _Children(_CLIENT_PAGES)
CLIENT_BYTES = _Children(_CLIENT_BYTES)
CLIENT_BATCH_SECONDS = _Children(_CLIENT_BATCH_SECONDS)

# -- Prefetcher (pool/prefetch.py) -----------------------------------------------------------------
PREFETCH_PAGES = Counter("l3pool_prefetch_pages_total", "Pages a prefetch brought into L2 (its intact prefix)")
PREFETCH_INTERRUPTS = Counter(
    "l3pool_prefetch_interrupts_total", "Prefetches interrupt() stopped before the end of their keys"
)
PREFETCH_ERRORS = Counter("l3pool_prefetch_errors_total", "Prefetches ended by an exception or a full L2")

# -- StageLocks (pool/pplock.py) -----------------------------------------------------------------
PPLOCK_WAIT_SECONDS = Histogram(
    "l3pool_pplock_wait_seconds",
    "Time a pipeline stage > 0 waited in join() for stage 0's lock",
    buckets=WAIT_BUCKETS,
)
PPLOCK_ACQUIRE_SECONDS = Histogram(
    "l3pool_pplock_acquire_seconds", "Time stage 0 took to look up and lock a request's pages", buckets=LATENCY_BUCKETS
)
PPLOCK_TIMEOUTS = Counter("l3pool_pplock_timeouts_total", "join() calls that found no lock within their timeout")

# -- TieredCache (cache/controller.py) -----------------------------------------------------------
CACHE_REQUESTS = Counter("l3pool_cache_requests_total", "Requests load() served")
_CACHE_HIT_PAGES = Counter("l3pool_cache_hit_pages_total", "Pages a request found per tier (l1, l2, l3)", ["tier"])
_CACHE_HIT_BYTES = Counter("l3pool_cache_hit_bytes_total", "Bytes of the pages found per tier", ["tier"])
CACHE_MISS_PAGES = Counter("l3pool_cache_miss_pages_total", "Pages no tier had (computed by the engine)")
_CACHE_WAIT_SECONDS = Histogram(
    "l3pool_cache_wait_seconds",
    "Time a caller waited on a tier: l2 = an L2 -> L1 load, l3 = the L3 -> L2 prefetch at load()",
    ["tier"],
    buckets=WAIT_BUCKETS,
)
_CACHE_EVICTIONS = Counter("l3pool_cache_evictions_total", "Pages evicted per tier (l1, l2)", ["tier"])
CACHE_GHOST_HITS = Counter(
    "l3pool_cache_ghost_hits_total", "Rebuilt pages found in the ghost list (evicted before: proven reuse)"
)
CACHE_ERRORS = Counter("l3pool_cache_errors_total", "Errors of the cache's background work")
_CACHE_BACKUP_SKIPS = Counter(
    "l3pool_cache_backup_skipped_pages_total",
    "Pages not backed up L1 -> L2 because every L2 page was pinned, by cause (l3_slow: pages waiting for the L3 "
    "writer held the room; l2_pinned: requests' pins alone)",
    ["cause"],
)
CACHE_HIT_PAGES = _Children(_CACHE_HIT_PAGES)
CACHE_HIT_BYTES = _Children(_CACHE_HIT_BYTES)
CACHE_WAIT_SECONDS = _Children(_CACHE_WAIT_SECONDS)
CACHE_EVICTIONS = _Children(_CACHE_EVICTIONS)
CACHE_BACKUP_SKIPS = _Children(_CACHE_BACKUP_SKIPS)

# -- engine adapters (adapters/) -----------------------------------------------------------------
_ADAPTER_CALLS = Counter(
    "l3pool_adapter_calls_total", "Calls an engine made into its adapter (the pages are in l3pool_client_*)",
    ["engine", "op"],
)  # fmt: skip
_ADAPTER_ERRORS = Counter(
    "l3pool_adapter_errors_total", "Adapter calls that failed and answered the engine 'not stored' / 'miss'",
    ["engine"],
)  # fmt: skip
ADAPTER_CALLS = _Children(_ADAPTER_CALLS)
ADAPTER_ERRORS = _Children(_ADAPTER_ERRORS)


def add_tally(acc: dict[str, int], tallies: Iterable[tuple[str, int]]) -> None:
    """Add one batch's (outcome, pages) pairs to a call's running totals."""
    for outcome, n in tallies:
        acc[outcome] = acc.get(outcome, 0) + n


def count_pages(op: str, counts: dict[str, int], nbytes: int) -> None:
    """Record one client call (all its batches): pages per outcome and the bytes it moved.
    Batch latencies go to `CLIENT_BATCH_SECONDS(op).observe(s)` as each batch returns."""
    for outcome, n in counts.items():
        if n:
            CLIENT_PAGES(op, outcome).inc(n)
    if nbytes:
        CLIENT_BYTES(op).inc(nbytes)


# -- serving -------------------------------------------------------------------------------------
class MetricsError(RuntimeError):
    """The metrics endpoint could not be started (the message is one line)."""


@dataclass
class MetricsServer:
    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}/metrics"

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def check_port(port: int | str, what: str = "--metrics-port") -> int:
    """A port number 0..65535 (0: metrics off); ValueError with a one-line reason otherwise."""
    try:
        p = int(str(port).strip())
    except ValueError:
        raise ValueError(f"{what} {port!r}: expected a port number 1-65535 (0 = off)") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"{what} {port!r}: expected a port number 1-65535 (0 = off)")
    return p


def serve(port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve every l3pool metric at http://host:port/metrics from a daemon thread.

    Binds only the address given (default loopback; 0.0.0.0 only when a caller passes it).
    MetricsError naming the address when the port is taken, not ours to bind, or out of range."""
    p = check_port(port)
    if p == 0:
        raise MetricsError("metrics port 0: nothing to serve")
    if not AVAILABLE:
        raise MetricsError("cannot serve metrics: the prometheus_client package is not installed (pip install it)")
    try:
        server, thread = start_http_server(p, addr=host, registry=REGISTRY)
    except (OSError, OverflowError, socket.gaierror) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise MetricsError(f"cannot serve metrics on {host}:{p}: {reason}") from None
    return MetricsServer(host, int(server.server_address[1]), server, thread)
