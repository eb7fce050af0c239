"""Prometheus metrics (l3pool/metrics.py) scraped over HTTP and parsed with Prometheus' text parser,
against real etcd + mooncake_master processes (conftest fixtures) and real agents; and Mooncake's
glog lines kept off the terminal by the command line unless -v (l3pool/logs.py)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from l3pool import metrics
from l3pool.logs import TqdmHandler
from l3pool.pool.protocols import Outcome
from l3pool.procenv import python_env

from .conftest import (
    REPO,
    EtcdServer,
    MasterServer,
    agent_args,
    agent_process,
    free_ports,
    slack,
    wait_for,
)
from .pool_helpers import master_store

MiB = 1 << 20
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of a /metrics endpoint, parsed by prometheus_client's text parser."""
    with urllib.request.urlopen(url, timeout=3) as r:
        assert r.status == 200
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def val(s: Samples, name: str, **labels: str) -> float:
    """The sample of `name` with these labels, summed over the engine ranks (tp_rank, pp_rank)."""
    want = frozenset(labels.items())
    return sum(
        v for (n, lb), v in s.items()
        if n == name and want <= lb and {k for k, _ in lb - want} <= set(metrics.RANK_LABELS)
    )  # fmt: skip


def ranked(**labels: str) -> dict[str, str]:
    """These labels plus this process's engine rank labels."""
    return {**labels, **dict(zip(metrics.RANK_LABELS, metrics.rank(), strict=True))}


def delta(a: Samples, b: Samples, name: str, **labels: str) -> float:
    return val(b, name, **labels) - val(a, name, **labels)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """This test process's own metrics, served as an embedding engine would."""
    server = metrics.serve(free_ports(1)[0], "127.0.0.1")
    yield server.url
    server.shutdown()


# -- unit: per-batch counting ------------------------------------------------------------------
def test_tally_counts_every_outcome_of_a_batch() -> None:
    from l3pool.pool.client import tally

    rng = np.random.default_rng(5)
    outs = list(Outcome)
    for n in (0, 1, 64, 512):
        res = [outs[i] for i in rng.choice(len(outs), n, p=[0.6] + [0.4 / (len(outs) - 1)] * (len(outs) - 1))]
        got = dict(tally(res))
        assert got == {o.value: c for o, c in Counter(res).items()}
        assert sum(got.values()) == n
    assert tally([Outcome.OK] * 8) == [("ok", 8)]


def test_serve_binds_only_the_given_address_and_refuses_a_taken_port() -> None:
    (port,) = free_ports(1)
    server = metrics.serve(port, "127.0.0.1")
    try:
        assert server.url == f"http://127.0.0.1:{port}/metrics"
        text = urllib.request.urlopen(server.url, timeout=3).read().decode()
        assert "l3pool_client_pages_total" in text
        assert "l3pool_agent_" not in text  # the agent's families are served by the agent only
        with pytest.raises(metrics.MetricsError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            metrics.serve(port, "127.0.0.1")
    finally:
        server.shutdown()
    for bad in ("70000", "-1", "http"):
        with pytest.raises(ValueError, match="expected a port number"):
            metrics.check_port(bad)


def test_log_records_go_through_tqdm_and_leave_the_bar_whole(capsys: pytest.CaptureFixture[str]) -> None:
    from tqdm import tqdm

    log = logging.getLogger("l3pool.test_metrics.tqdm")
    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    try:
        with tqdm(total=3, desc="bar", file=sys.stderr, mininterval=0, ascii=True) as bar:
            bar.update(1)
            log.warning("a line in the middle")
            bar.update(2)
    finally:
        log.removeHandler(handler)
        log.propagate = True
    err = capsys.readouterr().err
    # tqdm.write cleared the bar first: the message starts a line of its own (after the bar's \r)
    line = next(ln for ln in err.split("\n") if "a line in the middle" in ln)
    assert line.split("\r")[-1] == "WARNING a line in the middle", repr(err)
    assert "bar: 100%" in err


def test_outcome_labels_are_the_outcome_values() -> None:
    assert metrics.OUTCOMES == tuple(o.value for o in Outcome)


# families of each role's endpoint (sample names, `_total`/`_bucket`/... included)
AGENT_SAMPLES = {
    "l3pool_agent_donated_bytes", "l3pool_agent_registered", "l3pool_agent_mooncake_healthy",
    "l3pool_agent_reregistrations_total", "l3pool_agent_used_bytes", "l3pool_lease_renewals_total",
    "l3pool_lease_renewal_failures_total", "l3pool_build_info",
}  # fmt: skip


def _build_labels() -> dict[str, str]:
    import platform
    from importlib.metadata import version

    import l3pool

    return {"version": l3pool.__version__, "python": platform.python_version(),
            "mooncake": version("mooncake-transfer-engine-non-cuda")}  # fmt: skip


def test_engine_endpoint_has_its_families_preinitialised_and_no_created(endpoint: str) -> None:
    """Every fixed label value exists (at 0 until counted) on the first scrape; no `_created`
    twins; nothing of the agent's; a build_info series naming this process's versions."""
    s = scrape(endpoint)
    names = {n for n, _ in s}
    assert not [n for n in names if n.endswith("_created")]
    assert not [n for n in names if n.startswith("l3pool_agent_")]
    assert val(s, "l3pool_build_info", **_build_labels()) == 1
    want: list[tuple[str, dict[str, str]]] = [
        *[("l3pool_client_pages_total", {"op": "put", "outcome": o}) for o in (*metrics.OUTCOMES, "skipped")],
        *[("l3pool_client_pages_total", {"op": "exists", "outcome": o}) for o in ("ok", "miss", "unavailable")],
        *[("l3pool_client_pages_total", {"op": "get", "outcome": o}) for o in ("ok", "miss", "transfer_fail")],
        *[("l3pool_client_bytes_total", {"op": op}) for op in ("get", "put")],
        *[("l3pool_client_batch_seconds_count", {"op": op}) for op in ("exists", "get", "put")],
        *[(f"l3pool_cache_hit_{u}_total", {"tier": t}) for u in ("pages", "bytes", "tokens") for t in metrics.TIERS],
        ("l3pool_cache_miss_tokens_total", {}), ("l3pool_cache_requested_tokens_total", {}),
        *[("l3pool_cache_evictions_total", {"tier": t}) for t in ("l1", "l2")],
        *[("l3pool_cache_wait_seconds_count", {"tier": t}) for t in ("l2", "l3")],
        *[("l3pool_lease_renewals_total", {"owner": o}) for o in ("stats", "other")],
        *[("l3pool_adapter_calls_total", {"engine": "sglang", "op": op}) for op in ("exists", "get", "set")],
        *[(f"l3pool_adapter_{n}_total", {"engine": "sglang"}) for n in ("errors", "lookup_tokens", "hit_tokens")],
    ]  # fmt: skip
    # the lease counters are per process (one per owner), the engine families per engine rank too
    missing = [(n, lb) for n, lb in want if (n, frozenset((lb if "lease" in n else ranked(**lb)).items())) not in s]
    assert not missing, missing
    assert ("l3pool_lease_renewals_total", frozenset({("owner", "member")})) not in s  # the agent's


# -- the agent's endpoint ------------------------------------------------------------------------
def test_agent_serves_its_metrics(etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str) -> None:
    (port,) = free_ports(1)
    args = agent_args(
        etcd_server, mooncake_master, prefix, "--segment-size", "24MiB", "--id", "dn-metrics", "--lease-ttl", "2",
        "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--master-admin", mooncake_master.admin_url,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    with agent_process(args) as agent:
        agent.wait_registered()
        first = scrape(url)
        # only the agent's own families (plus process_*): none of the engine side's
        ours = {n for n, _ in first if n.startswith("l3pool_")}
        assert ours == AGENT_SAMPLES, ours ^ AGENT_SAMPLES
        assert {n for n, _ in first if not n.startswith("l3pool_")} <= {
            "process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
            "process_cpu_seconds_total", "process_open_fds", "process_max_fds",
        }  # fmt: skip
        assert val(first, "l3pool_build_info", **_build_labels()) == 1
        # pre-initialised: the failure counter exists at 0 before any failure
        assert ("l3pool_lease_renewal_failures_total", frozenset({("owner", "member")})) in first
        assert [k for k in first if k[0] == "l3pool_lease_renewals_total"] == [
            ("l3pool_lease_renewals_total", frozenset({("owner", "member")}))
        ]
        assert val(first, "l3pool_agent_donated_bytes") == 24 * MiB
        assert val(first, "l3pool_agent_registered") == 1
        assert val(first, "l3pool_agent_mooncake_healthy") == 1
        renewed = val(first, "l3pool_lease_renewals_total", owner="member")
        # keep-alives every ttl/3 = 0.67 s
        wait_for(
            lambda: val(scrape(url), "l3pool_lease_renewals_total", owner="member") >= renewed + 2,
            5.0 * slack(), "two more lease renewals",
        )  # fmt: skip
        later = scrape(url)
        assert val(later, "l3pool_lease_renewal_failures_total", owner="member") == 0
        assert val(later, "l3pool_agent_reregistrations_total") == 0
        # used bytes: what the master says about this agent's segment (nothing stored: 0)
        with contextlib.closing(etcd_server.client()) as c:
            rec = json.loads(c.get(f"{prefix}/members/dn-metrics").value)  # type: ignore[union-attr]
        assert rec["metrics"] == url
        used = mooncake_master.admin(f"/query_segment?segment={rec['segment']}")
        want = int(re.search(r"Used\(bytes\)\s*:\s*(\d+)", used).group(1))  # type: ignore[union-attr]
        assert ("l3pool_agent_used_bytes", frozenset()) in later
        assert val(later, "l3pool_agent_used_bytes") == want
        # inspect links the agent's endpoint and summarises the master's own /metrics
        r = subprocess.run(
            [sys.executable, "-m", "l3pool.cli", "inspect", "--etcd", etcd_server.endpoints, "--key-prefix", prefix,
             "--master-admin", mooncake_master.admin_url, "--json"],
            capture_output=True, text=True, timeout=30, cwd=REPO, env=python_env(),
        )  # fmt: skip
        assert r.returncode == 0 and r.stderr == "", r.stderr
        report = json.loads(r.stdout)
        assert [m["metrics"] for m in report["members"]] == [url]
        master = report["master"]
        assert master["metrics_url"] == f"{mooncake_master.admin_url}/metrics"
        theirs = scrape(master["metrics_url"])
        assert master["metrics"]["evicted_keys"] == val(theirs, "master_evicted_key_count")
        assert master["metrics"]["put_items"] == val(theirs, "master_batch_put_start_items_total")
        assert master["metrics"]["series"] >= 100  # 133 unlabelled samples in 0.3.13
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.wait(10) == 0
    assert not any("Traceback" in ln for ln in agent.lines)
    with pytest.raises(OSError):
        scrape(url)  # the endpoint went away with the agent


def _run_agent(args: list[str], timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "l3pool.cli", "agent", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=python_env(),
    )  # fmt: skip


@pytest.mark.parametrize("port", ["70000", "-5", "nine", "{taken}"], ids=["range", "negative", "text", "in-use"])
def test_bad_metrics_port_is_one_line_and_exit_2(
    etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str, port: str
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        value = port.replace("{taken}", str(taken))
        args = agent_args(etcd_server, mooncake_master, prefix, "--segment-size", "16MiB", "--metrics-port", value)
        r = _run_agent(args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("l3pool agent: error: "), r.stderr
    if port == "{taken}":
        assert f"cannot serve metrics on 127.0.0.1:{taken}: Address already in use" in lines[0]
    else:
        assert f"--metrics-port {value!r}: expected a port number 1-65535" in lines[0]
    with contextlib.closing(etcd_server.client()) as c:
        assert c.get_prefix(f"{prefix}/members/") == []  # it never registered


# -- glog -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_mooncake_glog_lines_stay_off_stderr_unless_verbose(
    etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, verbose: bool,
) -> None:  # fmt: skip
    monkeypatch.setenv("L3POOL_LOG_DIR", str(tmp_path))
    agent_id = f"dn-glog{int(verbose)}"
    args = agent_args(etcd_server, mooncake_master, prefix, "--segment-size", "16MiB", "--id", agent_id)
    proc = subprocess.Popen(
        [sys.executable, "-m", "l3pool.cli", *(["-v"] if verbose else []), "agent", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        cwd=REPO, env=python_env(), start_new_session=True,
    )  # fmt: skip
    try:
        with contextlib.closing(etcd_server.client()) as c:
            wait_for(lambda: c.get(f"{prefix}/members/{agent_id}") is not None, 15.0, "the agent to register")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=5)
    assert proc.returncode == 0, err
    lines = err.splitlines()
    glog = [ln for ln in lines if GLOG.match(ln) or "InitGoogleLogging" in ln]
    assert any("donating 16777216 bytes" in ln for ln in lines), err  # our own lines stay on stderr
    files = list(tmp_path.glob("mooncake-agent-*.log"))
    if verbose:
        assert any("InitGoogleLogging" in ln for ln in glog), err
        assert any("metadata not found" in ln for ln in glog), err  # Mooncake's E line on every start
        assert files == []
    else:
        assert glog == [], glog
        assert len(files) == 1 and files[0].name == f"mooncake-agent-{proc.pid}.log"
        text = files[0].read_text()
        assert "InitGoogleLogging" in text and "metadata not found" in text
        assert "donating" not in text  # ours never go to the file


# -- L3Client, StageLocks and TieredCache in this process ---------------------------------------
@pytest.fixture(scope="module")
def store(mooncake_master: MasterServer) -> Iterator[object]:
    s = master_store(mooncake_master, segment_bytes=64 << 20)
    yield s
    s.close()


def test_client_counters_are_exact(store: object, endpoint: str) -> None:
    torch = pytest.importorskip("torch")
    from l2core import HostKVPool, KVSpec, L2Config
    from l3pool.pool.client import L3Client
    from l3pool.pool.keys import Namespace, page_hashes
    from l3pool.pool.trailer import TRAILER_BYTES

    spec = KVSpec.mla(4, page_size=16)
    pool = HostKVPool(L2Config(kv=spec, layout="page_first_direct", tokens=64 * 16, pin="never"))
    pool.buffer.copy_(torch.randint(0, 256, (pool.buffer.numel(),), dtype=torch.uint8))
    ns = Namespace.for_pool(spec, "page_first_direct", "metrics-test", tenant=uuid.uuid4().hex)
    client = L3Client(pool, store, ns, batch_pages=8)  # type: ignore[arg-type]
    pb = pool.layout.page_bytes
    keys = ns.keys(page_hashes(np.random.default_rng(3).integers(0, 1 << 20, 32 * 16), 16))
    present, absent = keys[:20], keys[20:26]
    try:
        a = scrape(endpoint)
        assert client.put(present, range(20)) == [Outcome.OK] * 20  # 3 batches
        assert client.put(present[:5], range(20, 25)) == [Outcome.OK] * 5  # 1 batch, all skipped
        res = client.get(present + absent, range(30, 56))  # 4 batches
        assert res == [Outcome.OK] * 20 + [Outcome.MISS] * 6
        assert client.lookup(present + absent) == 20  # one batch_is_exist of 26 keys
        # a bare page (no trailer) under a key of this namespace: a get rejects it
        bad = keys[30]
        assert store.put([bad], [pool.buffer.data_ptr()], [pb]) == [Outcome.OK]  # type: ignore[attr-defined]
        assert client.get([bad], [60]) == [Outcome.MISS]  # 1 batch
        b = scrape(endpoint)
    finally:
        client.close()
        pool.close()
    d = {
        (op, o): delta(a, b, "l3pool_client_pages_total", op=op, outcome=o)
        for op in ("put", "get", "exists")
        for o in ("ok", "skipped", "miss", "pending", "transfer_fail")
    }
    assert {k: v for k, v in d.items() if v} == {
        ("put", "ok"): 20, ("put", "skipped"): 5, ("get", "ok"): 20, ("get", "miss"): 7,
        ("exists", "ok"): 20, ("exists", "miss"): 6,
    }  # fmt: skip
    assert delta(a, b, "l3pool_client_bytes_total", op="put") == 20 * pb == client.stats.bytes_put
    assert delta(a, b, "l3pool_client_bytes_total", op="get") == 20 * pb == client.stats.bytes_got
    assert delta(a, b, "l3pool_client_batch_seconds_count", op="put") == 4
    assert delta(a, b, "l3pool_client_batch_seconds_count", op="get") == 5
    assert delta(a, b, "l3pool_client_batch_seconds_count", op="exists") == 1
    assert delta(a, b, "l3pool_client_batch_seconds_sum", op="get") > 0
    assert delta(a, b, "l3pool_client_lookups_total") == 1
    assert delta(a, b, "l3pool_client_lookup_hit_pages_total") == 20
    assert delta(a, b, "l3pool_client_trailer_rejections_total") == 1 == client.stats.trailer_rejections
    assert delta(a, b, "l3pool_client_checksum_failures_total") == 0
    assert TRAILER_BYTES == 32


def test_pplock_wait_and_timeout(store: object, etcd_server: EtcdServer, prefix: str, endpoint: str) -> None:
    from l3pool.pool.keys import Namespace, page_hashes
    from l3pool.pool.metadata import Metadata
    from l3pool.pool.pplock import StageLocks, UnknownRequest

    pytest.importorskip("torch")
    from l2core import KVSpec

    spec = KVSpec.mla(4, page_size=16)
    tenant = uuid.uuid4().hex
    nss = [Namespace.for_pool(spec, "page_first_direct", "m", layers=lr, tenant=tenant) for lr in ((0, 4), (4, 8))]
    hs = page_hashes(np.arange(4 * 16), 16)
    md = Metadata(etcd_server.client(), prefix)
    locks = [StageLocks(md, store, nss, s, ttl=5, refresh_s=1.0) for s in range(2)]  # type: ignore[arg-type]
    try:
        a = scrape(endpoint)
        with pytest.raises(UnknownRequest):
            locks[1].join("nobody", timeout=0.05)
        assert locks[0].acquire("q", hs).length == 0  # nothing stored: a lock of length 0
        assert locks[1].join("q", timeout=2.0) == 0
        locks[0].report_done("q")
        locks[1].report_done("q")
        b = scrape(endpoint)
    finally:
        for lk in locks:
            lk.close()
        md.etcd.close()
    assert delta(a, b, "l3pool_pplock_timeouts_total") == 1
    assert delta(a, b, "l3pool_pplock_acquire_seconds_count") == 1
    assert delta(a, b, "l3pool_pplock_wait_seconds_count") == 1
    waited = delta(a, b, "l3pool_pplock_wait_seconds_sum")
    assert 0 <= waited < 2.0 and math.isfinite(waited)


@pytest.mark.usefixtures("native")
def test_cache_stats_are_mirrored(store: object, endpoint: str) -> None:
    from l3pool.cache import CacheConfig

    from .cache_helpers import SPEC, Engine, chain

    tenant = uuid.uuid4().hex
    a = scrape(endpoint)
    w = Engine(store=store, tenant=tenant, l1_pages=8, cfg=CacheConfig(writer_linger_ms=20))
    r = Engine(store=store, tenant=tenant, l1_pages=32, l2_pages=32, cfg=CacheConfig(prefetch_policy="wait_complete"))
    try:
        hs = chain(1, 6)
        w.run("w1", hs)
        w.run("w2", chain(2, 6))  # 8 L1 pages: the second request evicts the first's
        w.run("w3", hs[:4])
        w.cache.flush()
        r.run("r1", chain(3, 2, prefix=hs[:6]))  # 6 pages from L3, 2 computed
        r.run("r2", chain(3, 2, prefix=hs[:6]))  # all 8 in L1
        b = scrape(endpoint)
        stats = [w.cache.stats(), r.cache.stats()]
    finally:
        w.close()
        r.close()
    for tier in ("l1", "l2", "l3"):
        assert delta(a, b, "l3pool_cache_hit_pages_total", tier=tier) == sum(s["hit_pages"][tier] for s in stats)
        assert delta(a, b, "l3pool_cache_hit_bytes_total", tier=tier) == sum(s["hit_bytes"][tier] for s in stats)
        # LMCache-style token counters: pages x page_size
        hit_tokens = sum(s["hit_pages"][tier] for s in stats) * SPEC.page_size
        assert delta(a, b, "l3pool_cache_hit_tokens_total", tier=tier) == hit_tokens
    assert stats[1]["hit_pages"]["l3"] == 6 and stats[1]["hit_bytes"]["l3"] == 6 * SPEC.page_bytes
    assert delta(a, b, "l3pool_cache_requests_total") == sum(s["requests"] for s in stats) == 5
    assert delta(a, b, "l3pool_cache_miss_pages_total") == sum(s["miss_pages"] for s in stats)
    misses = sum(s["miss_pages"] for s in stats)
    hits = sum(sum(s["hit_pages"].values()) for s in stats)
    assert delta(a, b, "l3pool_cache_miss_tokens_total") == misses * SPEC.page_size > 0
    assert delta(a, b, "l3pool_cache_requested_tokens_total") == (hits + misses) * SPEC.page_size
    for tier in ("l1", "l2"):
        assert delta(a, b, "l3pool_cache_evictions_total", tier=tier) == sum(s["evictions"][tier] for s in stats)
    assert stats[0]["evictions"]["l1"] > 0
    assert delta(a, b, "l3pool_cache_ghost_hits_total") == sum(s["ghost_hits"] for s in stats)
    for cause in ("l3_slow", "l2_pinned"):
        got = delta(a, b, "l3pool_cache_backup_skipped_pages_total", cause=cause)
        assert got == sum(s["backup_skips"][cause] for s in stats)
    assert delta(a, b, "l3pool_cache_wait_seconds_count", tier="l3") >= 1  # r1's load waited for its prefetch
    assert delta(a, b, "l3pool_cache_wait_seconds_sum", tier="l3") == pytest.approx(stats[1]["wait_s"]["l3"])
    assert delta(a, b, "l3pool_prefetch_pages_total") == 6
    assert delta(a, b, "l3pool_cache_errors_total") == 0


def test_cache_occupancy_is_read_from_stats_at_scrape_time(endpoint: str) -> None:
    """l3pool_cache_pages{tier,state}, the writer backlog and the active requests: what the open
    caches' stats() say at that scrape (summed over the process's caches), gone once closed."""
    from .cache_helpers import Engine, chain

    base = scrape(endpoint)
    e = Engine(l1_pages=8, l2_pages=16)
    try:
        e.cache.match("r1", chain(1, 3))
        s = scrape(endpoint)
        st = e.cache.stats()
        for tier in ("l1", "l2"):
            for state in metrics.CACHE_PAGE_STATES:
                got = val(s, "l3pool_cache_pages", tier=tier, state=state) - val(base, "l3pool_cache_pages", tier=tier,
                                                                                 state=state)  # fmt: skip
                assert got == st[f"{tier}_pages"][state], (tier, state)
        assert delta(base, s, "l3pool_cache_pages", tier="l1", state="total") == 8
        assert delta(base, s, "l3pool_cache_active_requests") == st["active_requests"] == 1
        assert delta(base, s, "l3pool_cache_writer_pending_pages") == st["writer_pending"] == 0
        assert (("l3pool_cache_pages", frozenset(ranked(tier="l2", state="pinned").items()))) in s
    finally:
        e.close()
    after = scrape(endpoint)
    assert val(after, "l3pool_cache_pages", tier="l1", state="total") == val(base, "l3pool_cache_pages", tier="l1",
                                                                               state="total")  # fmt: skip


def test_set_rank_labels_the_engine_series() -> None:
    from prometheus_client import REGISTRY

    from .cache_helpers import Engine, chain

    saved = metrics.rank()
    try:
        metrics.set_rank(3, 1)
        lb = {"tp_rank": "3", "pp_rank": "1"}
        before = REGISTRY.get_sample_value("l3pool_cache_requests_total", lb)
        assert before is not None  # every family is there for the rank from the first scrape
        hit = REGISTRY.get_sample_value("l3pool_cache_hit_pages_total", {**lb, "tier": "l2"})
        e = Engine(l1_pages=8, l2_pages=16)
        try:
            e.run("a", chain(1, 3))
            assert REGISTRY.get_sample_value("l3pool_cache_requests_total", lb) == before + 1  # open: from stats()
        finally:
            e.close()
        assert REGISTRY.get_sample_value("l3pool_cache_requests_total", lb) == before + 1  # closed: still counted
        assert REGISTRY.get_sample_value("l3pool_cache_hit_pages_total", {**lb, "tier": "l2"}) == hit
        assert REGISTRY.get_sample_value("l3pool_cache_pages", {**lb, "tier": "l1", "state": "total"}) is not None
        with pytest.raises(ValueError, match="rank"):
            metrics.set_rank(-1, 0)
    finally:
        metrics.set_rank(*map(int, saved))


def test_breakers_are_read_at_scrape_time() -> None:
    from prometheus_client import REGISTRY

    from l3pool.pool.breaker import Breaker

    lb = ranked(dependency="mooncake")

    def v(name: str) -> float:
        return REGISTRY.get_sample_value(name, lb) or 0.0

    before = (v("l3pool_breaker_open"), v("l3pool_breaker_trips_total"), v("l3pool_breaker_short_circuits_total"))
    br = Breaker("test master", probe=lambda: False, backoff_s=(30.0, 30.0))
    metrics.watch_breaker(br, "mooncake")
    try:
        br.trip("RPC_FAIL")
        assert not br.allow()
        assert v("l3pool_breaker_open") == before[0] + 1
        assert v("l3pool_breaker_trips_total") == before[1] + 1
        assert v("l3pool_breaker_short_circuits_total") == before[2] + 1
        with pytest.raises(ValueError, match="dependency"):
            metrics.watch_breaker(br, "redis")
    finally:
        metrics.unwatch_breaker(br)
        br.close()
    assert v("l3pool_breaker_open") == before[0]


def test_metrics_overhead_of_a_512_page_get_is_small() -> None:
    """What counting costs one get of 512 pages in 8 batches of 64, done as L3Client.get does it:
    per batch one latency observation and one tally; per call the outcome and byte counters.
    Printed; bounded generously (a 512-page get moves 18+ MB: milliseconds)."""
    from l3pool.pool.client import tally

    res = [Outcome.OK] * 60 + [Outcome.MISS] * 4
    lat = metrics.CLIENT_BATCH_SECONDS("get")
    n = 500
    t0 = time.perf_counter()
    for _ in range(n):
        acc: dict[str, int] = {}
        for _ in range(8):
            tb = time.perf_counter()
            lat.observe(time.perf_counter() - tb)
            metrics.add_tally(acc, tally(res))
        metrics.count_pages("get", acc, acc["ok"] * 36864)
    per_get = (time.perf_counter() - t0) / n
    print(f"\nmetrics cost per 512-page get (8 batches of 64): {per_get * 1e6:.1f} us")
    assert per_get < 1e-3 * slack()


def test_tqdm_handler_writes_to_current_stderr() -> None:
    buf = io.StringIO()
    old, sys.stderr = sys.stderr, buf
    try:
        h = TqdmHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        h.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("there",), None))
    finally:
        sys.stderr = old
    assert buf.getvalue() == "hello there\n"


def _without_prometheus_client(tmp_path: Path) -> dict[str, str]:
    """A child environment in which `import prometheus_client` fails wherever it is installed (the
    H200 host has it on PYTHONPATH, this venv may have it): a stand-in package that raises
    ImportError, first on PYTHONPATH."""
    block = tmp_path / "block"
    (block / "prometheus_client").mkdir(parents=True)
    (block / "prometheus_client" / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    return python_env({"PYTHONPATH": os.pathsep.join([str(block), os.environ.get("PYTHONPATH", "")])})


def test_without_prometheus_client_metrics_are_inert(tmp_path: Path) -> None:
    """Without prometheus_client: counting is a no-op, serving is one clear error."""
    code = (
        "from l3pool import metrics\n"
        "print('available', metrics.AVAILABLE)\n"
        "metrics.CLIENT_PAGES('get', 'ok').inc(3); metrics.CLIENT_BATCH_SECONDS('get').observe(0.1)\n"
        "metrics.agent_used_bytes().set(5); metrics.count_pages('get', {'ok': 3}, 9)\n"
        "try:\n    metrics.serve(1234)\nexcept metrics.MetricsError as e:\n    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=_without_prometheus_client(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "available False",
        "cannot serve metrics: the prometheus_client package is not installed (pip install it)",
    ]


def test_agent_metrics_port_without_prometheus_client_is_one_line(
    tmp_path: Path, etcd_server: EtcdServer, mooncake_master: MasterServer, prefix: str
) -> None:
    (port,) = free_ports(1)
    args = agent_args(etcd_server, mooncake_master, prefix, "--segment-size", "16MiB", "--metrics-port", str(port))
    r = subprocess.run([sys.executable, "-m", "l3pool", "agent", *args], capture_output=True, text=True, timeout=60,
                       cwd=REPO, env=_without_prometheus_client(tmp_path))  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "--metrics-port: cannot serve metrics: the prometheus_client package is not installed" in r.stderr
