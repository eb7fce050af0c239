"""deploy/monitoring/: the Grafana dashboard is a dashboard (panels with PromQL targets), the alert
rules parse as Prometheus rule groups, and every l3pool series either names is one the code
exports: collected from the live registries after making each exporter (the engine families,
the cache and breaker collectors, a Router with its metrics attached, the agent's families, the
index collector over a status())."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
MON = REPO / "deploy" / "monitoring"
SERIES = re.compile(r"\b((?:l3pool|process)_[a-z0-9_]+)")
# Prometheus' own series (what a scrape records about itself), not ours
BUILTIN = {"up"}


def _exported() -> set[str]:
    from l3pool import metrics
    from l3pool.index.metrics import watch_index
    from l3pool.router import Router
    from l3pool.router.metrics import attach

    attach(Router("cache_aware", ["x0", "x1"], page_size=16, page_bytes=1024))
    metrics.agent_used_bytes()  # made on first use (an agent with --master-admin)
    status = {"etcd_ok": True, "event_lag_ms": {"p50": 1.0, "p99": 2.0}, "instances": {}}
    unwatch = watch_index(lambda: status)
    try:
        names: set[str] = set()
        for reg in (metrics.ENGINE_REGISTRY, metrics.AGENT_REGISTRY, metrics.INDEX_REGISTRY):
            for fam in reg.collect():
                names.update(s.name for s in fam.samples)
        return names
    finally:
        unwatch()


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return _exported()


def _panels(d: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in d.get("panels", []):
        yield p
        yield from _panels(p)


def test_dashboard_is_a_grafana_dashboard_of_exported_series(exported: set[str]) -> None:
    d = json.loads((MON / "grafana-l3pool.json").read_text())
    assert isinstance(d["title"], str) and d["uid"] and isinstance(d["schemaVersion"], int)
    graphs = [p for p in _panels(d) if p["type"] != "row"]
    assert len(graphs) >= 20
    ids = [p["id"] for p in _panels(d)]
    assert len(ids) == len(set(ids))
    seen: set[str] = set()
    for p in graphs:
        assert p["title"] and {"h", "w", "x", "y"} <= set(p["gridPos"]), p
        assert p["targets"], p["title"]
        ours: set[str] = set()
        for t in p["targets"]:
            names = set(SERIES.findall(t["expr"]))
            assert not names - exported, (p["title"], names - exported)
            assert set(re.findall(r"\b([a-z_]+)\{", t["expr"])) - names <= BUILTIN, t["expr"]
            ours |= names
        assert ours, p["title"]  # every panel shows at least one l3pool series
        seen |= ours
    # the dashboard covers the pool, the index, the cache and the router
    for prefix in ("l3pool_agent_", "l3pool_client_", "l3pool_index_", "l3pool_cache_", "l3pool_router_"):
        assert any(n.startswith(prefix) for n in seen), prefix
    for must in ("l3pool_cache_pages", "l3pool_cache_writer_pending_pages", "l3pool_index_event_lag_seconds"):
        assert must in seen


def test_alert_rules_parse_and_name_exported_series(exported: set[str]) -> None:
    doc = yaml.safe_load((MON / "prometheus-alerts.yml").read_text())
    alerts: dict[str, str] = {}
    for g in doc["groups"]:
        assert isinstance(g["name"], str) and g["rules"]
        for r in g["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
            assert r["alert"] not in alerts and r["labels"]["severity"] in ("warning", "critical")
            assert re.fullmatch(r"\d+[smh]", r["for"]) and r["annotations"]["summary"]
            alerts[r["alert"]] = r["expr"]
            names = set(SERIES.findall(r["expr"]))
            others = set(re.findall(r"\b([a-z_]+)\{", r["expr"])) - names
            assert names or others <= BUILTIN, r
            assert not names - exported, (r["alert"], names - exported)
            assert others <= BUILTIN, (r["alert"], others)
    # what the issue asks alerts for: index lagging / resyncing, bad messages, L3 errors and the
    # breaker, writer backlog, agent down
    for want in ("L3PoolIndexLagging", "L3PoolIndexResyncing", "L3PoolIndexBadMessages", "L3PoolL3Errors",
                 "L3PoolBreakerOpen", "L3PoolWriterBacklogHigh", "L3PoolAgentDown"):  # fmt: skip
        assert want in alerts, want


def test_the_check_catches_a_series_that_does_not_exist(exported: set[str]) -> None:
    assert "l3pool_cache_pages" in exported and "l3pool_index_resyncs_total" in exported
    assert not set(SERIES.findall("rate(l3pool_cache_no_such_thing_total[5m])")) <= exported
