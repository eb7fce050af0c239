"""The router's Prometheus families: decisions per policy, reason and chosen instance, decision
latency, prefetch orders, and index fallbacks (the caller's query of the global index failed).

Opt-in, from outside the Router: `attach(router)` wraps that one Router object's `route` (the
instance attribute; the class and every other Router are untouched), so router.py needs no
change to be measured:

    from l3pool.router.metrics import attach
    rm = attach(router)                       # every router.route() is now counted and timed
    hits = guarded_index.query(page_hashes, namespace=ns)   # l3pool.index.GuardedIndex
    d = router.route(rid, tokens=n, hits=hits)  # a fallback answer (d.index_source) counts as one
    rm.index_fallback("error")                # a caller's own fallback (e.g. no index configured)

Wired into Router itself (one line at the end of `Router.__init__`, see l3pool/router/README.md),
every Router is measured the same way. Families live in the engine registry (prometheus_client's
default): `l3pool.metrics.serve(port)` or an engine's own /metrics serves them.

Labels: policy (the three policy names or a custom policy's), reason (the Decision's), instance
(the chosen instance's name: a cluster's fixed set of prefill instances, not a request or key id),
cause (unavailable, timeout, error). Decisions are counted, not the requests' ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from l3pool import metrics

if TYPE_CHECKING:
    from l3pool.router.router import Decision, Router

# pricing N candidates is tens of microseconds in Python; a scheduler under load may take ms
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)
FALLBACK_CAUSES = ("unavailable", "timeout", "error")
KNOWN_POLICIES = ("cache_aware", "round_robin", "dynamo_like")

_DECISIONS = metrics.Counter(
    "l3pool_router_decisions_total", "Routing decisions per policy, reason and chosen instance",
    ["policy", "reason", "instance"],
)  # fmt: skip
_DECISION_SECONDS = metrics.Histogram(
    "l3pool_router_decision_seconds", "Time route() took to price the candidates and pick one", ["policy"],
    buckets=DECISION_BUCKETS,
)  # fmt: skip
_PREFETCH_ORDERS = metrics.Counter(
    "l3pool_router_prefetch_orders_total", "Decisions that carried an L3 -> L2 prefetch order", ["policy"]
)
_PREFETCH_PAGES = metrics.Counter(
    "l3pool_router_prefetch_pages_total", "Pages those prefetch orders asked to bring from L3 into L2", ["policy"]
)
_INDEX_FALLBACKS = metrics.Counter(
    "l3pool_router_index_fallbacks_total",
    "Routing decisions made without the global index's answer (its query failed), per cause",
    ["policy", "cause"],
)
_ERRORS = metrics.Counter("l3pool_router_errors_total", "route() calls that raised (RouterError: bad input)",
                          ["policy"])  # fmt: skip
DECISIONS = metrics._Children(_DECISIONS)
DECISION_SECONDS = metrics._Children(_DECISION_SECONDS).preinit(*[(p,) for p in KNOWN_POLICIES])
PREFETCH_ORDERS = metrics._Children(_PREFETCH_ORDERS).preinit(*[(p,) for p in KNOWN_POLICIES])
PREFETCH_PAGES = metrics._Children(_PREFETCH_PAGES).preinit(*[(p,) for p in KNOWN_POLICIES])
INDEX_FALLBACKS = metrics._Children(_INDEX_FALLBACKS).preinit(
    *[(p, c) for p in KNOWN_POLICIES for c in FALLBACK_CAUSES]
)
ERRORS = metrics._Children(_ERRORS).preinit(*[(p,) for p in KNOWN_POLICIES])


class RouterMetrics:
    """One Router's measuring: `decided` after each route(), `index_fallback` from its caller."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.policy = str(router.policy.name)
        for inst in router.instances:  # its instances' decision series exist from the first scrape
            DECISIONS(self.policy, _first_reason(self.policy), inst)

    def decided(self, d: Decision, seconds: float) -> None:
        DECISIONS(d.policy, d.reason, d.instance).inc()
        if d.index_source != "index":  # priced on l3pool.index.GuardedIndex's fallback, not an answer
            INDEX_FALLBACKS(d.policy, "unavailable").inc()
        DECISION_SECONDS(d.policy).observe(seconds)
        if d.prefetch is not None:
            PREFETCH_ORDERS(d.policy).inc()
            PREFETCH_PAGES(d.policy).inc(d.prefetch.pages)

    def failed(self) -> None:
        ERRORS(self.policy).inc()

    def index_fallback(self, cause: str = "unavailable") -> None:
        """The caller routes this request without the index's answer (its query failed)."""
        if cause not in FALLBACK_CAUSES:
            raise ValueError(f"index fallback cause {cause!r}: expected one of {FALLBACK_CAUSES}")
        INDEX_FALLBACKS(self.policy, cause).inc()


def _first_reason(policy: str) -> str:
    return {"round_robin": "round_robin", "dynamo_like": "lowest_cost"}.get(policy, "lowest_ttft")


def attach(router: Router) -> RouterMetrics:
    """Measure this Router (module docstring): its `route` is wrapped on the instance; attaching
    twice returns the first RouterMetrics."""
    rm: RouterMetrics | None = getattr(router, "_l3pool_metrics", None)
    if rm is not None:
        return rm
    rm = RouterMetrics(router)
    route: Callable[..., Decision] = router.route

    def timed_route(*args: Any, **kwargs: Any) -> Decision:
        t0 = time.perf_counter()
        try:
            d = route(*args, **kwargs)
        except Exception:
            rm.failed()
            raise
        rm.decided(d, time.perf_counter() - t0)
        return d

    router.route = timed_route  # type: ignore[method-assign]
    router._l3pool_metrics = rm  # type: ignore[attr-defined]
    return rm
