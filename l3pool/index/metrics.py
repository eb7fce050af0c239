"""The global index's Prometheus families, read from `IndexService.status()` at scrape time.

A collector, not a second tally: every scrape calls `status()` once (what `l3pool index --status`
prints) and turns its counters into series, so the endpoint and the status can never disagree.
`l3pool index --metrics-port PORT` registers it into `l3pool.metrics.INDEX_REGISTRY` and serves
that registry (with `process_*` and `l3pool_build_info`):

    unwatch = watch_index(svc.status)          # svc: a started IndexService
    server = metrics.serve(port, host, role="index")
    ...
    server.shutdown(); unwatch()

No label carries an instance id: per-instance detail stays in `--status`; the series count
instances by state instead, so a scrape keeps its size however many instances come and go.
`status()` failing (a bug) exports `l3pool_index_up 0` and nothing else for that scrape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from l3pool import metrics

log = logging.getLogger(__name__)

# (series name without _total, status path, help): counters, each a process total of status()
COUNTERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("l3pool_index_events_applied", ("events_applied",), "KV event messages the index applied"),
    ("l3pool_index_resyncs", ("resyncs",), "Instance resynchronisations (snapshot requests) the index started"),
    ("l3pool_index_bad_messages", ("bad_messages",),
     "Malformed event messages, snapshots and requests dropped, and oversized query frames"),
    ("l3pool_index_bad_frames", ("bad_frames",), "Query connections closed for a frame beyond the size limit"),
    ("l3pool_index_unknown_messages", ("unknown_messages",), "Event messages from instances the index does not know"),
    ("l3pool_index_refused_keys", ("refused_keys",), "Page keys refused because the table was full"),
    ("l3pool_index_loop_errors", ("loop_errors",), "Errors applying an event (that instance resynchronised)"),
    ("l3pool_index_etcd_errors", ("etcd_errors",), "Failed etcd membership reads"),
    ("l3pool_index_sweep_errors", ("sweeper", "errors"), "Sweeps (leave, replace, age, clear_pool) that failed"),
    ("l3pool_index_queries", ("index", "queries"), "Prefix queries answered"),
    ("l3pool_index_membership_watch_failures", ("membership", "watch_failures"), "etcd membership watches that failed"),
)  # fmt: skip
# gauges: (series name, status path, help)
GAUGES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("l3pool_index_pages", ("index", "entries"), "Distinct pages the index holds"),
    ("l3pool_index_capacity_pages", ("index", "capacity_pages"), "Distinct pages the index can hold"),
    ("l3pool_index_pool_hints", ("index", "pool_hints"), "Pages with an L3 (pool) hint"),
    ("l3pool_index_namespaces_cached", ("index", "namespaces_cached"), "Namespaces whose salt the index has cached"),
    ("l3pool_index_bytes", ("index", "nbytes"), "Memory of the index table"),
    ("l3pool_index_sweeps_queued", ("sweeper", "queued"), "Sweeps waiting for the sweeper thread"),
    ("l3pool_index_event_lag_samples", ("event_lag_ms", "samples"), "Event lag samples the quantiles are taken over"),
    ("l3pool_index_query_samples", ("query_ms", "samples"), "Query timings the quantiles are taken over"),
)
QUANTILES = (("0.5", "p50"), ("0.99", "p99"))
INSTANCE_STATES = ("live", "resyncing", "leaving")


def _get(st: dict[str, Any], path: tuple[str, ...]) -> float:
    v: Any = st
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


def _families(st: dict[str, Any] | None) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("l3pool_index_up", "1 while the index answered its own status at this scrape",
                            value=0.0 if st is None else 1.0)  # fmt: skip
    if st is None:
        return
    for name, path, doc in COUNTERS:
        yield CounterMetricFamily(name, doc, value=_get(st, path))
    for name, path, doc in GAUGES:
        yield GaugeMetricFamily(name, doc, value=_get(st, path))
    yield GaugeMetricFamily("l3pool_index_etcd_ok", "1 while the index reaches etcd", value=float(bool(st["etcd_ok"])))
    lag = GaugeMetricFamily("l3pool_index_event_lag_seconds",
                            "Event lag (publish to apply) over the last samples, per quantile; NaN before any",
                            labels=["quantile"])  # fmt: skip
    for q, key in QUANTILES:
        ms = st.get("event_lag_ms", {}).get(key)
        lag.add_metric([q], math.nan if ms is None else float(ms) / 1e3)
    yield lag
    qs = GaugeMetricFamily("l3pool_index_query_seconds",
                           "Time the index took to answer a query (table lookup + encoding) over the last "
                           "10,000 queries, per quantile; NaN before any", labels=["quantile"])  # fmt: skip
    for q, key in QUANTILES:
        ms = st.get("query_ms", {}).get(key)
        qs.add_metric([q], math.nan if ms is None else float(ms) / 1e3)
    yield qs
    inst = GaugeMetricFamily(
        "l3pool_index_instances",
        "Instances the index knows, by state (live: answered for; resyncing: waiting for a snapshot or a gap "
        "healed; leaving: its entries being swept)",
        labels=["state"],
    )
    counts = dict.fromkeys(INSTANCE_STATES, 0)
    for d in st.get("instances", {}).values():
        counts["leaving" if d.get("leaving") else "live" if d.get("live") else "resyncing"] += 1
    for state in INSTANCE_STATES:
        inst.add_metric([state], float(counts[state]))
    yield inst


class IndexCollector:
    """prometheus_client collector over one status() function (module docstring)."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def describe(self) -> Iterator[Any]:
        empty = {"etcd_ok": False, "event_lag_ms": {}, "query_ms": {}, "instances": {}}
        return _families(empty)

    def collect(self) -> Iterator[Any]:
        try:
            st: dict[str, Any] | None = self._status()
        except Exception:  # a scrape must not raise into the HTTP thread: said, and up = 0
            log.exception("index metrics: status() failed")
            st = None
        return _families(st)


def watch_index(status: Callable[[], dict[str, Any]], registry: Any = None) -> Callable[[], None]:
    """Register a collector over `status` (default into INDEX_REGISTRY); returns its unregister.
    A no-op without prometheus_client."""
    reg = metrics.INDEX_REGISTRY if registry is None else registry
    if not metrics.AVAILABLE or reg is None:
        return lambda: None
    c = IndexCollector(status)
    reg.register(c)
    return lambda: reg.unregister(c)
