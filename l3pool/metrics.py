"""Every Prometheus metric l3pool exports, and the helper that serves them.

One home: modules that count something import the metric objects from here; the only other
metric modules are the index's scrape-time collector (l3pool/index/metrics.py) and the router's
decision metrics (l3pool/router/metrics.py). Names follow Prometheus conventions (`l3pool_` prefix, `_total` counters,
`_bytes_total` byte counters, `_seconds` histograms, plain names for gauges). Labels take values
from small fixed sets only (operation, outcome, tier, owner, engine): never keys, namespaces,
request ids or member ids, so a scrape stays the same size however long the process runs.

Two registries, one per role, so an endpoint exports only what its process can change:
- `ENGINE_REGISTRY` (prometheus_client's default registry): the client, prefetch, PP-lock, cache
  and adapter families, plus the engine side's lease counters (owner stats, other). Per process:
  every L3Client (or cache) of a process adds to the same series, and an engine that already
  serves the default registry (its own /metrics) carries ours too.
- `AGENT_REGISTRY`: the node agent's families, its registration lease (owner member) and the
  `process_*` collector; `l3pool agent --metrics-port` serves only this one.
- `INDEX_REGISTRY`: the global index's families, read from `IndexService.status()` at scrape
  time by the collector in l3pool/index/metrics.py (no second tally), and `process_*`;
  `l3pool index --metrics-port` serves it.
Derived at scrape time, by collectors registered from their own package (one home per concept):
the index's (l3pool/index/metrics.py) and the TieredCache's series, counts and occupancy (below). The router's
families are in l3pool/router/metrics.py (engine registry).
All carry `l3pool_build_info{version, python, mooncake}` (always 1). `serve()` drops
prometheus_client's `<name>_created` samples (a second, timestamp-valued series per counter and
histogram that dashboards mistake for data), and every label value of the fixed sets is
pre-initialised, so a series exists at 0 from the first scrape (rate() and absent() work).
Counters only grow; a test or a report reads the difference between two scrapes.

Cost (measured, see l3pool/README.md "Metrics"): a batch call updates a handful of counters
and one histogram, whatever its page count, so a 512-page get pays a few microseconds.

    from l3pool.metrics import serve
    server = serve(9464, "127.0.0.1")      # an engine's families; role="agent" for the agent's
                                           # MetricsError (one line) when the port is unusable
    ...
    server.shutdown()

Import-light (prometheus_client is pure Python): the agent imports this without torch. Where
prometheus_client is missing (an interpreter outside the install, e.g. a bare python3 running
`l3pool cluster status`) every metric is inert and `serve()` says so; nothing else changes.
"""

from __future__ import annotations

import logging
import platform
import socket
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
    from prometheus_client.process_collector import ProcessCollector

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
    REGISTRY = CollectorRegistry = ProcessCollector = None  # type: ignore[assignment,misc]

ENGINE_REGISTRY: Any = REGISTRY
AGENT_REGISTRY: Any = CollectorRegistry(auto_describe=True) if AVAILABLE else None
INDEX_REGISTRY: Any = CollectorRegistry(auto_describe=True) if AVAILABLE else None
if AVAILABLE:
    ProcessCollector(registry=AGENT_REGISTRY)
    ProcessCollector(registry=INDEX_REGISTRY)
ROLES = ("engine", "agent", "index")
# the fixed label values, pre-initialised below (OUTCOMES = pool.protocols.Outcome's values; a test checks)
OUTCOMES = ("ok", "miss", "pool_full", "lease", "transfer_fail", "unavailable", "bad_request", "error", "pending")
TIERS = ("l1", "l2", "l3")
ENGINES = ("sglang",)

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

    def preinit(self, *label_sets: tuple[str, ...]) -> _Children:
        """Create these children now: their series are exported at 0 before the first update."""
        for labels in label_sets:
            self(*labels)
        return self


class _ByOwner:
    """The lease counters: one metric per role (same name in each registry), picked by owner."""

    def __init__(self, agent: _Children, engine: _Children) -> None:
        self._agent, self._engine = agent, engine

    def __call__(self, owner: str) -> Any:
        return (self._agent if owner == "member" else self._engine)(owner)


def _build_labels() -> tuple[str, str, str]:
    """(l3pool version, Python version, mooncake wheel version or "none"), without importing mooncake."""
    from importlib import metadata

    from l3pool import __version__

    mooncake = "none"
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            mooncake = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    return __version__, platform.python_version(), mooncake


def _build_info(registry: Any) -> None:
    g = Gauge("l3pool_build_info", "Always 1: this process's l3pool, Python and mooncake versions",
              ["version", "python", "mooncake"], registry=registry)  # fmt: skip
    g.labels(*_build_labels()).set(1)


# -- node agent ----------------------------------------------------------------------------------
_A = {"registry": AGENT_REGISTRY}
AGENT_DONATED_BYTES = Gauge(
    "l3pool_agent_donated_bytes", "DRAM this agent donates to the pool (its Mooncake segment)", **_A
)
AGENT_REGISTERED = Gauge(
    "l3pool_agent_registered", "1 while the agent's member key is registered in etcd, else 0", **_A
)
AGENT_MOONCAKE_HEALTHY = Gauge("l3pool_agent_mooncake_healthy", "1 while its Mooncake client reaches the master", **_A)
AGENT_REREGISTRATIONS = Counter(
    "l3pool_agent_reregistrations_total", "Times the agent registered again (lease lost, key missing)", **_A
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
            registry=AGENT_REGISTRY,
        )
    return _agent_used


# -- etcd leases (pool/etcd.py LeaseKeeper) --------------------------------------------------------
# owner: member (an agent's registration: the agent's registry), stats (an L3Client's published
# counters) and other (the engine's)
def _lease_counters(registry: Any, owners: tuple[str, ...]) -> tuple[_Children, _Children]:
    ok = Counter("l3pool_lease_renewals_total", "Successful etcd lease keep-alives", ["owner"], registry=registry)
    bad = Counter("l3pool_lease_renewal_failures_total", "etcd lease keep-alives that failed (etcd down or lease gone)",
                  ["owner"], registry=registry)  # fmt: skip
    return _Children(ok).preinit(*[(o,) for o in owners]), _Children(bad).preinit(*[(o,) for o in owners])


_agent_lease, _engine_lease = (
    _lease_counters(AGENT_REGISTRY, ("member",)),
    _lease_counters(REGISTRY, ("stats", "other")),
)
LEASE_RENEWALS = _ByOwner(_agent_lease[0], _engine_lease[0])
LEASE_RENEWAL_FAILURES = _ByOwner(_agent_lease[1], _engine_lease[1])

# -- engine ranks ----------------------------------------------------------------------------------
# Every engine-side family below carries tp_rank and pp_rank first: SGLang runs one process per
# TP x PP rank and serves them through prometheus_client's multiprocess mode, which sums a
# counter's same-labelled samples over processes; the rank labels keep them apart. A process is
# one rank ("0", "0" until `set_rank`: what a lone engine is); the SGLang backend sets its own.
RANK_LABELS = ("tp_rank", "pp_rank")
_rank: tuple[str, str] = ("0", "0")
_ranked: list[_Ranked] = []


class _Ranked:
    """An engine family labelled (tp_rank, pp_rank, *labels): called with its own labels, it
    answers the child of this process's rank (a dict lookup); a family with no labels of its own
    takes inc()/observe() directly. Its preinit label sets are created for every rank set."""

    __slots__ = ("_children", "_metric", "_sets")

    def __init__(self, metric: Any, scalar: bool) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}
        self._sets: list[tuple[str, ...]] = [()] if scalar else []
        _ranked.append(self)
        self._preinit_rank()

    def __call__(self, *labels: str) -> Any:
        key = (*_rank, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._metric.labels(*key)
        return child

    def preinit(self, *label_sets: tuple[str, ...]) -> _Ranked:
        self._sets.extend(label_sets)
        self._preinit_rank()
        return self

    def _preinit_rank(self) -> None:
        for labels in self._sets:
            self(*labels)

    def inc(self, amount: float = 1) -> None:
        self().inc(amount)

    def observe(self, value: float) -> None:
        self().observe(value)


def _rc(name: str, doc: str, labels: Iterable[str] = (), **kw: Any) -> _Ranked:
    labels = tuple(labels)
    return _Ranked(Counter(name, doc, [*RANK_LABELS, *labels], **kw), scalar=not labels)


def _rh(name: str, doc: str, labels: Iterable[str] = (), **kw: Any) -> _Ranked:
    labels = tuple(labels)
    return _Ranked(Histogram(name, doc, [*RANK_LABELS, *labels], **kw), scalar=not labels)


def set_rank(tp_rank: int, pp_rank: int) -> None:
    """This process's engine rank: the tp_rank / pp_rank label of its engine families from now on
    (the series of the rank before stay as they are). Raises ValueError for a negative rank."""
    global _rank
    if int(tp_rank) < 0 or int(pp_rank) < 0:
        raise ValueError(f"rank (tp {tp_rank}, pp {pp_rank}): expected integers >= 0")
    _rank = (str(int(tp_rank)), str(int(pp_rank)))
    for r in _ranked:
        r._preinit_rank()


def rank() -> tuple[str, str]:
    """This process's (tp_rank, pp_rank) label values."""
    return _rank


# -- L3Client (pool/client.py) -------------------------------------------------------------------
_CLIENT_PAGES = _rc(
    "l3pool_client_pages_total",
    "Pages per operation (get, put, exists) and outcome (an Outcome value; put splits OK into ok = stored "
    "and skipped = already present)",
    ["op", "outcome"],
)
_CLIENT_BYTES = _rc(
    "l3pool_client_bytes_total", "Page bytes moved: get = copied into L2 and verified, put = stored", ["op"]
)
_CLIENT_BATCH_SECONDS = _rh(
    "l3pool_client_batch_seconds",
    "Latency of one batch call (up to batch_pages pages) per operation",
    ["op"],
    buckets=LATENCY_BUCKETS,
)
CLIENT_LOOKUPS = _rc("l3pool_client_lookups_total", "lookup() calls (longest present prefix)")
CLIENT_LOOKUP_HIT_PAGES = _rc("l3pool_client_lookup_hit_pages_total", "Pages in the prefixes lookup() found")
CLIENT_TRAILER_REJECTIONS = _rc(
    "l3pool_client_trailer_rejections_total", "Objects whose trailer or size did not bind them to their key (misses)"
)
CLIENT_CHECKSUM_FAILURES = _rc(
    "l3pool_client_checksum_failures_total", "Objects whose page bytes did not match their checksum (misses)"
)
CLIENT_PAGES = (_CLIENT_PAGES).preinit(
    *[("exists", o) for o in ("ok", "miss", "unavailable")],
    *[("get", o) for o in OUTCOMES if o != "pending"],
    *[("put", o) for o in (*OUTCOMES, "skipped")],
)
CLIENT_BYTES = (_CLIENT_BYTES).preinit(("get",), ("put",))
CLIENT_BATCH_SECONDS = (_CLIENT_BATCH_SECONDS).preinit(("exists",), ("get",), ("put",))

# -- Prefetcher (pool/prefetch.py) -----------------------------------------------------------------
PREFETCH_PAGES = _rc("l3pool_prefetch_pages_total", "Pages a prefetch brought into L2 (its intact prefix)")
PREFETCH_INTERRUPTS = _rc(
    "l3pool_prefetch_interrupts_total", "Prefetches interrupt() stopped before the end of their keys"
)
PREFETCH_ERRORS = _rc("l3pool_prefetch_errors_total", "Prefetches ended by an exception or a full L2")

# -- StageLocks (pool/pplock.py) -----------------------------------------------------------------
PPLOCK_WAIT_SECONDS = _rh(
    "l3pool_pplock_wait_seconds",
    "Time a pipeline stage > 0 waited in join() for stage 0's lock",
    buckets=WAIT_BUCKETS,
)
PPLOCK_ACQUIRE_SECONDS = _rh(
    "l3pool_pplock_acquire_seconds", "Time stage 0 took to look up and lock a request's pages", buckets=LATENCY_BUCKETS
)
PPLOCK_TIMEOUTS = _rc("l3pool_pplock_timeouts_total", "join() calls that found no lock within their timeout")

# -- TieredCache (cache/controller.py) -----------------------------------------------------------
# Derived at scrape time from each cache's CacheStats (stats()), counted there once: no second tally.
# The counters: (family, help, stats() key, label, label values); a cache's counts stay in them after
# it closed (folded into `_retired` by unwatch_cache), so they only grow.
CACHE_COUNTERS: tuple[tuple[str, str, str, str | None, tuple[str, ...]], ...] = (
    ("l3pool_cache_requests", "Requests load() served", "requests", None, ()),
    ("l3pool_cache_hit_pages", "Pages a request found per tier (l1, l2, l3)", "hit_pages", "tier", TIERS),
    ("l3pool_cache_hit_bytes", "Bytes of the pages found per tier", "hit_bytes", "tier", TIERS),
    ("l3pool_cache_miss_pages", "Pages no tier had (computed by the engine)", "miss_pages", None, ()),
    # token-denominated twins (pages x page_size), as LMCache dashboards count (lmcache:num_hit_tokens,
    # lmcache:num_requested_tokens): only whole pages are cached, so a request's tail is never counted
    ("l3pool_cache_hit_tokens", "Tokens of the pages found per tier (pages x page_size)", "hit_tokens", "tier", TIERS),
    ("l3pool_cache_miss_tokens", "Tokens of the pages no tier had (pages x page_size)", "miss_tokens", None, ()),
    ("l3pool_cache_requested_tokens", "Tokens of the whole pages requests asked for (hit + miss tokens)",
     "requested_tokens", None, ()),
    ("l3pool_cache_evictions", "Pages evicted per tier (l1, l2)", "evictions", "tier", ("l1", "l2")),
    ("l3pool_cache_ghost_hits", "Rebuilt pages found in the ghost list (evicted before: proven reuse)",
     "ghost_hits", None, ()),
    ("l3pool_cache_errors", "Errors of the cache's background work", "errors", None, ()),
    ("l3pool_cache_backup_skipped_pages",
     "Pages not backed up L1 -> L2 because every L2 page was pinned, by cause (l3_slow: pages waiting for the L3 "
     "writer held the room; l2_pinned: requests' pins alone)", "backup_skips", "cause", ("l3_slow", "l2_pinned")),
)  # fmt: skip
CACHE_WAIT_TIERS = ("l2", "l3")  # stats()["wait_counts"][tier]: per WAIT_BUCKETS bucket, then +Inf
_WAIT_DOC = "Time a caller waited on a tier: l2 = an L2 -> L1 load, l3 = the L3 -> L2 prefetch at load()"

# occupancy, derived from each open TieredCache's stats() at scrape time too: the cache registers
# itself (`watch_cache`) when made and leaves (`unwatch_cache`) at close(); the gauges sum the
# process's open caches, labelled with its rank
CACHE_PAGE_STATES = ("total", "free", "cached", "pinned")
_caches: weakref.WeakSet[Any] = weakref.WeakSet()
_caches_mu = threading.Lock()  # a cache leaves (its counts folded) atomically with respect to a scrape
_retired: dict[str, Any] = {}  # the counter keys of closed caches' stats, summed


def _sum(a: Any, b: Any) -> Any:
    """a + b over the shapes of stats() (numbers, lists of bucket counts, dicts of them); a: None = 0."""
    if isinstance(b, dict):
        return {**(a or {}), **{k: _sum((a or {}).get(k), v) for k, v in b.items()}}
    if isinstance(b, list):
        return list(b) if a is None else [x + y for x, y in zip(a, b, strict=True)]
    return b if a is None else a + b


def _fold(into: dict[str, Any], st: dict[str, Any]) -> None:
    for key in (*(c[2] for c in CACHE_COUNTERS), "wait_s", "wait_counts"):
        if key in st:
            into[key] = _sum(into.get(key), st[key])


def watch_cache(cache: Any) -> None:
    """Export this cache's counts and occupancy (its `stats()`) from now on."""
    with _caches_mu:
        _caches.add(cache)


def unwatch_cache(cache: Any, final: dict[str, Any]) -> None:
    """The cache closed: its occupancy leaves the gauges, its `final` counts (stats()) stay in the counters."""
    with _caches_mu:
        if cache in _caches:
            _fold(_retired, final)
            _caches.discard(cache)


class _CacheCollector:
    """The l3pool_cache_* counters and wait histogram (the open caches' stats() plus the closed ones'
    last counts); l3pool_cache_pages{tier,state}, l3pool_cache_writer_pending_pages,
    l3pool_cache_active_requests, l3pool_cache_ghost_entries: the sums over the open caches' stats()."""

    def describe(self) -> Iterator[Any]:
        return self._families([], {})

    def collect(self) -> Iterator[Any]:
        stats = []
        with _caches_mu:
            for c in list(_caches):
                try:
                    stats.append(c.stats())
                except Exception:  # closing meanwhile, or a bug: that cache is left out of this scrape
                    log.debug("cache metrics: stats() failed", exc_info=True)
            total: dict[str, Any] = {}
            _fold(total, _retired)
        for st in stats:
            _fold(total, st)
        return self._families(stats, total)

    @staticmethod
    def _families(stats: list[dict[str, Any]], total: dict[str, Any]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        r = list(_rank)
        for name, doc, key, label, values in CACHE_COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=[*RANK_LABELS, *([label] if label else [])])
            v = total.get(key, {} if label else 0)
            if label is None:
                fam.add_metric(r, float(v))
            for lv in values:
                fam.add_metric([*r, lv], float(v.get(lv, 0)))
            yield fam
        wait = HistogramMetricFamily("l3pool_cache_wait_seconds", _WAIT_DOC, labels=[*RANK_LABELS, "tier"])
        n = len(WAIT_BUCKETS) + 1
        for tier in CACHE_WAIT_TIERS:
            counts = total.get("wait_counts", {}).get(tier, [0] * n)
            cum = [sum(counts[: i + 1]) for i in range(n)]
            buckets = [(repr(float(le)), float(c)) for le, c in zip(WAIT_BUCKETS, cum, strict=False)]
            wait.add_metric([*r, tier], [*buckets, ("+Inf", float(cum[-1]))], total.get("wait_s", {}).get(tier, 0.0))
        yield wait
        pages = GaugeMetricFamily("l3pool_cache_pages",
                                  "Pages of the process's caches per tier (l1, l2) and state (total, free in its "
                                  "allocator, cached, pinned by requests), from stats()",
                                  labels=[*RANK_LABELS, "tier", "state"])  # fmt: skip
        for tier in ("l1", "l2"):
            for state in CACHE_PAGE_STATES:
                pages.add_metric([*r, tier, state], float(sum(st[f"{tier}_pages"][state] for st in stats)))
        yield pages
        for name, key, doc in (
            ("l3pool_cache_writer_pending_pages", "writer_pending", "Pages queued for the L3 writer (its backlog)"),
            ("l3pool_cache_active_requests", "active_requests", "Requests loaded and not released yet"),
            ("l3pool_cache_ghost_entries", "ghost_entries", "Entries of the ghost list (evicted pages remembered)"),
        ):
            g = GaugeMetricFamily(name, doc, labels=list(RANK_LABELS))
            g.add_metric(r, float(sum(st.get(key, 0) for st in stats)))
            yield g


if AVAILABLE:
    ENGINE_REGISTRY.register(_CacheCollector())

# -- circuit breakers (pool/breaker.py): the Mooncake store's and etcd clients', read at scrape time
BREAKER_DEPENDENCIES = ("mooncake", "etcd")
_breakers: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def watch_breaker(breaker: Any, dependency: str) -> None:
    """Export this Breaker's state and counters (its `stats()`) under `dependency` (mooncake, etcd)."""
    if dependency not in BREAKER_DEPENDENCIES:
        raise ValueError(f"breaker dependency {dependency!r}: expected one of {BREAKER_DEPENDENCIES}")
    _breakers[breaker] = dependency


def unwatch_breaker(breaker: Any) -> None:
    _breakers.pop(breaker, None)


class _BreakerCollector:
    """l3pool_breaker_open{dependency} (breakers open now), l3pool_breaker_trips_total and
    l3pool_breaker_short_circuits_total{dependency}: sums over the process's live breakers (a
    closed client's counts leave with it: a counter reset, which rate() absorbs)."""

    def describe(self) -> Iterator[Any]:
        return self._families({})

    def collect(self) -> Iterator[Any]:
        sums: dict[str, list[float]] = {}
        for br, dep in list(_breakers.items()):
            try:
                st = br.stats()
            except Exception:
                log.debug("breaker metrics: stats() failed", exc_info=True)
                continue
            acc = sums.setdefault(dep, [0.0, 0.0, 0.0])
            acc[0] += st.state == "open"
            acc[1] += st.trips
            acc[2] += st.short_circuits
        return self._families(sums)

    @staticmethod
    def _families(sums: dict[str, list[float]]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        r, lbs = list(_rank), [*RANK_LABELS, "dependency"]
        fams: tuple[Any, ...] = (
            GaugeMetricFamily("l3pool_breaker_open", "Circuit breakers open now (calls fail fast)", labels=lbs),
            CounterMetricFamily("l3pool_breaker_trips", "Times a circuit breaker opened", labels=lbs),
            CounterMetricFamily(
                "l3pool_breaker_short_circuits",
                "Calls a circuit breaker answered at once (UNAVAILABLE) while open",
                labels=lbs,
            ),
        )
        for dep in BREAKER_DEPENDENCIES:
            v = sums.get(dep, [0.0, 0.0, 0.0])
            for fam, x in zip(fams, v, strict=True):
                fam.add_metric([*r, dep], x)
        yield from fams


if AVAILABLE:
    ENGINE_REGISTRY.register(_BreakerCollector())

# -- KV events (cache/events.py) and the global index (index/) -----------------------------------
KV_EVENTS_SENT = _rc("l3pool_kv_events_sent_total", "KV event messages (batches) an instance published")
KV_EVENT_PAGES = _rc("l3pool_kv_event_pages_total", "Page keys carried by published KV events")
KV_EVENTS_DROPPED = _rc(
    "l3pool_kv_events_dropped_total",
    "KV event operations an instance dropped (queue full or transport at its high-water mark); healed by resync",
)
KV_SNAPSHOTS_SERVED = _rc("l3pool_kv_snapshots_served_total", "Tier snapshots an instance served to an index")
# the global index's own families are derived from IndexService.status() at scrape time
# (l3pool/index/metrics.py) into INDEX_REGISTRY, served by `l3pool index --metrics-port`

# -- engine adapters (adapters/) -----------------------------------------------------------------
_ADAPTER_CALLS = _rc(
    "l3pool_adapter_calls_total", "Calls an engine made into its adapter (the pages are in l3pool_client_*)",
    ["engine", "op"],
)  # fmt: skip
_ADAPTER_ERRORS = _rc(
    "l3pool_adapter_errors_total", "Adapter calls that failed and answered the engine 'not stored' / 'miss'",
    ["engine"],
)  # fmt: skip
_ADAPTER_LOOKUP_TOKENS = _rc(
    "l3pool_adapter_lookup_tokens_total", "Tokens of the pages an engine asked about (exists calls; pages x page_size)",
    ["engine"],
)  # fmt: skip
_ADAPTER_HIT_TOKENS = _rc(
    "l3pool_adapter_hit_tokens_total", "Tokens of the leading pages those exists calls found (pages x page_size)",
    ["engine"],
)  # fmt: skip
ADAPTER_CALLS = (_ADAPTER_CALLS).preinit(*[(e, op) for e in ENGINES for op in ("exists", "get", "set")])
ADAPTER_ERRORS = (_ADAPTER_ERRORS).preinit(*[(e,) for e in ENGINES])
ADAPTER_LOOKUP_TOKENS = (_ADAPTER_LOOKUP_TOKENS).preinit(*[(e,) for e in ENGINES])
ADAPTER_HIT_TOKENS = (_ADAPTER_HIT_TOKENS).preinit(*[(e,) for e in ENGINES])

if AVAILABLE:
    _build_info(ENGINE_REGISTRY)
    _build_info(AGENT_REGISTRY)
    _build_info(INDEX_REGISTRY)


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


class _WithoutCreated(CollectorRegistry if AVAILABLE else object):  # type: ignore[misc]
    """A read-only view of a registry without prometheus_client's `<name>_created` samples."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def collect(self) -> Iterator[Any]:
        for m in self._inner.collect():
            if m.type in ("counter", "histogram", "summary", "gaugehistogram"):
                created = f"{m.name}_created"
                m.samples = [x for x in m.samples if x.name != created]
            yield m

    def restricted_registry(self, names: Iterable[str]) -> _WithoutCreated:
        return _WithoutCreated(self._inner.restricted_registry(names))


def registry(role: str) -> Any:
    """The registry of a role: "engine" (the default registry), "agent" or "index"."""
    if role not in ROLES:
        raise ValueError(f"metrics role {role!r}: expected one of {ROLES}")
    return {"agent": AGENT_REGISTRY, "index": INDEX_REGISTRY}.get(role, ENGINE_REGISTRY)


def serve(port: int, host: str = "127.0.0.1", role: str = "engine") -> MetricsServer:
    """Serve one role's l3pool metrics (module docstring) at http://host:port/metrics from a
    daemon thread, without `_created` samples.

    Binds only the address given (default loopback; 0.0.0.0 only when a caller passes it).
    MetricsError naming the address when the port is taken, not ours to bind, or out of range."""
    p = check_port(port)
    reg = registry(role)
    if p == 0:
        raise MetricsError("metrics port 0: nothing to serve")
    if not AVAILABLE:
        raise MetricsError("cannot serve metrics: the prometheus_client package is not installed (pip install it)")
    try:
        server, thread = start_http_server(p, addr=host, registry=_WithoutCreated(reg))
    except (OSError, OverflowError, socket.gaierror) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise MetricsError(f"cannot serve metrics on {host}:{p}: {reason}") from None
    return MetricsServer(host, int(server.server_address[1]), server, thread)
