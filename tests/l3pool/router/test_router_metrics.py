"""l3pool/router/metrics.py: attach() counts a Router's decisions by policy, reason and chosen
instance, times them, counts prefetch orders and the caller's index fallbacks; other Routers and
the Router class stay as they are."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from l3pool.router import Router, RouterError
from l3pool.router.metrics import attach

from .test_router import TOK, hits, router


def _v(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_decisions_are_counted_by_reason_and_instance_and_timed() -> None:
    r = router(names=("ma", "mb", "mc"))
    rm = attach(r)
    assert attach(r) is rm  # once per Router
    assert (
        REGISTRY.get_sample_value(
            "l3pool_router_decisions_total", {"policy": "cache_aware", "reason": "lowest_ttft", "instance": "mc"}
        )
        is not None
    )  # its instances' series exist before any decision
    before = {
        "best": _v("l3pool_router_decisions_total", policy="cache_aware", reason="lowest_ttft", instance="ma"),
        "count": _v("l3pool_router_decision_seconds_count", policy="cache_aware"),
        "orders": _v("l3pool_router_prefetch_orders_total", policy="cache_aware"),
        "pages": _v("l3pool_router_prefetch_pages_total", policy="cache_aware"),
        "errors": _v("l3pool_router_errors_total", policy="cache_aware"),
    }
    spills = {i: _v("l3pool_router_decisions_total", policy="cache_aware", reason="spill", instance=i)
              for i in ("mb", "mc")}  # fmt: skip
    d = r.route("q1", TOK, hits(ma=(0, 20, 20)))
    assert (d.instance, d.reason) == ("ma", "lowest_ttft")
    r.add_load("ma", "busy", work_s=2.0, tokens=20000)
    d2 = r.route("q2", TOK, hits(pool=30, ma=(30, 30, 30)))
    assert d2.reason == "spill" and d2.prefetch is not None
    with pytest.raises(RouterError):
        r.route("q1", TOK, hits())  # already routed
    assert _v("l3pool_router_decisions_total", policy="cache_aware", reason="lowest_ttft", instance="ma") == (
        before["best"] + 1
    )
    assert _v("l3pool_router_decisions_total", policy="cache_aware", reason="spill", instance=d2.instance) == (
        spills[d2.instance] + 1
    )
    assert _v("l3pool_router_decision_seconds_count", policy="cache_aware") == before["count"] + 2
    assert _v("l3pool_router_prefetch_orders_total", policy="cache_aware") == before["orders"] + 1
    assert _v("l3pool_router_prefetch_pages_total", policy="cache_aware") == before["pages"] + d2.prefetch.pages
    assert _v("l3pool_router_errors_total", policy="cache_aware") == before["errors"] + 1


def test_index_fallbacks_and_an_unattached_router() -> None:
    r = router("round_robin", names=("fa", "fb"))
    rm = attach(r)
    n = _v("l3pool_router_index_fallbacks_total", policy="round_robin", cause="timeout")
    rm.index_fallback("timeout")
    assert _v("l3pool_router_index_fallbacks_total", policy="round_robin", cause="timeout") == n + 1
    with pytest.raises(ValueError, match="cause"):
        rm.index_fallback("because")
    plain = router("round_robin", names=("fa", "fb"))
    before = _v("l3pool_router_decisions_total", policy="round_robin", reason="round_robin", instance="fa")
    plain.route("p1", TOK, hits())
    plain.route("p2", TOK, hits())
    assert _v("l3pool_router_decisions_total", policy="round_robin", reason="round_robin", instance="fa") == before
    assert "route" not in vars(plain) and Router.route is type(plain).route


def test_a_decision_on_a_guarded_fallback_counts_as_an_index_fallback() -> None:
    from l3pool.index.types import PrefixHits

    r = router("round_robin", names=("ga", "gb"))
    attach(r)
    n = _v("l3pool_router_index_fallbacks_total", policy="round_robin", cause="unavailable")
    r.route("g1", TOK, hits())  # the index's own answer
    assert _v("l3pool_router_index_fallbacks_total", policy="round_robin", cause="unavailable") == n
    r.route("g2", TOK, PrefixHits(pages=1, source="none", reason="index breaker open"))
    assert _v("l3pool_router_index_fallbacks_total", policy="round_robin", cause="unavailable") == n + 1
