"""`l3pool index --metrics-port`: a real index process against a real etcd, scraped over HTTP on
127.0.0.1; its series agree with its own `--status` (they are read from it at scrape time)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from l3pool.cache.events import KvEventPublisher
from l3pool.index.client import IndexClient, IndexUnavailable
from l3pool.index.metrics import COUNTERS, GAUGES, watch_index
from l3pool.pool.metadata import Metadata
from l3pool.procenv import python_env

from ..conftest import EtcdServer, free_port


def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(url, timeout=3) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}  # fmt: skip


def test_index_process_serves_its_status_as_series(etcd_server: EtcdServer, prefix: str) -> None:
    listen, mport = f"tcp://127.0.0.1:{free_port()}", free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "l3pool.cli", "index", "--etcd", etcd_server.endpoints, "--key-prefix", prefix,
         "--listen", listen, "--capacity-pages", "10000", "--duration", "60", "--poll", "0.2", "--json",
         "--metrics-port", str(mport)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(),
    )  # fmt: skip
    c = etcd_server.client()
    pub = KvEventPublisher("m-inst", "ns", heartbeat_s=0.2)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        url = first["metrics"]
        assert url == f"http://127.0.0.1:{mport}/metrics"
        s0 = _scrape(url)
        assert s0[("l3pool_index_up", frozenset())] == 1
        assert s0[("l3pool_index_instances", frozenset({("state", "live")}))] == 0
        assert ("process_cpu_seconds_total", frozenset()) in s0  # the process collector
        assert not any(name.endswith("_created") for name, _ in s0)
        pub.bind(lambda under_lock: (under_lock(), {"l1": np.arange(1, 8, dtype=np.uint64)})[1])
        pub.register(Metadata(c, prefix), ttl=5)
        deadline, st = time.monotonic() + 20, {}
        with IndexClient(listen, timeout_s=1.0) as cl:
            while time.monotonic() < deadline:
                try:
                    st = cl.status()
                except IndexUnavailable:
                    continue
                if st["instances"].get("m-inst", {}).get("live"):
                    break
                time.sleep(0.1)
            pub.stored("l1", np.arange(100, 103, dtype=np.uint64))  # one event message after the snapshot
            while time.monotonic() < deadline and cl.status()["index"]["entries"] < 10:
                time.sleep(0.05)
            assert cl.query(np.arange(1, 10, dtype=np.uint64), "ns").of("m-inst").l1 == 7
            s = _scrape(url)
            st = cl.status()
        assert s[("l3pool_index_instances", frozenset({("state", "live")}))] == 1
        assert s[("l3pool_index_pages", frozenset())] == st["index"]["entries"] == 10
        assert s[("l3pool_index_capacity_pages", frozenset())] >= 10000
        assert s[("l3pool_index_resyncs_total", frozenset())] == st["resyncs"] >= 1
        assert s[("l3pool_index_events_applied_total", frozenset())] == st["events_applied"] >= 1
        assert s[("l3pool_index_bad_messages_total", frozenset())] == st["bad_messages"] == 0
        assert s[("l3pool_index_etcd_ok", frozenset())] == 1
        assert s[("l3pool_index_namespaces_cached", frozenset())] == st["index"]["namespaces_cached"]
        lag = s[("l3pool_index_event_lag_seconds", frozenset({("quantile", "0.99")}))]
        assert 0 <= lag < 5
        assert s[("l3pool_index_queries_total", frozenset())] == st["index"]["queries"] >= 1
        assert s[("l3pool_index_query_samples", frozenset())] == st["query_ms"]["samples"] >= 1
        assert 0 < s[("l3pool_index_query_seconds", frozenset({("quantile", "0.5")}))] < 1
        proc.terminate()  # SIGTERM: a clean stop, the endpoint shut down
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    finally:
        pub.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        c.delete_prefix(prefix + "/")
        c.close()


def test_collector_reads_each_scrape_and_survives_a_failing_status() -> None:
    reg = CollectorRegistry()
    state = {"n": 0, "fail": False}

    def status() -> dict[str, object]:
        if state["fail"]:
            raise RuntimeError("boom")
        return {"events_applied": state["n"], "etcd_ok": True, "event_lag_ms": {"p50": None, "p99": 2.0},
                "instances": {"a": {"live": True}, "b": {"live": False}, "c": {"leaving": True}}}  # fmt: skip

    unwatch = watch_index(status, reg)
    state["n"] = 5
    assert reg.get_sample_value("l3pool_index_events_applied_total") == 5
    assert reg.get_sample_value("l3pool_index_event_lag_seconds", {"quantile": "0.99"}) == 0.002
    for st in ("live", "resyncing", "leaving"):
        assert reg.get_sample_value("l3pool_index_instances", {"state": st}) == 1
    assert reg.get_sample_value("l3pool_index_queries_total") == 0  # a missing key reads 0
    state["fail"] = True
    assert reg.get_sample_value("l3pool_index_up") == 0
    assert reg.get_sample_value("l3pool_index_events_applied_total") is None
    unwatch()
    assert reg.get_sample_value("l3pool_index_up") is None
    assert len({n for n, _, _ in COUNTERS + GAUGES}) == len(COUNTERS) + len(GAUGES)


def test_bad_metrics_port_is_one_line(etcd_server: EtcdServer, prefix: str) -> None:
    argv = [sys.executable, "-m", "l3pool.cli", "index", "--etcd", etcd_server.endpoints, "--metrics-port", "70000"]
    r = subprocess.run(argv, capture_output=True, text=True, env=python_env(), timeout=60)
    assert r.returncode == 2 and "--metrics-port" in r.stderr and r.stderr.count("error:") == 1, r.stderr
