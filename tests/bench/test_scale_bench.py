"""bench.scale: a tiny run against its own local clusters (the JSON contract, the plots, every
request's calls counted and asserted constant), the counting catching a request that makes one
call more, the trace, merging reports, bad input, and a clean teardown on Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import scale
from bench.scale._client import Client, L2Ring, Trace, TraceSpec, calls_per_request, hex_keys
from bench.scale._client import _namespaces as scale_namespaces
from l3pool.cliutil import guarded
from l3pool.cluster.local import LocalCluster
from l3pool.pool.pplock import StageLocks
from l3pool.procenv import python_env
from tests.conftest import default_sigint

ROOT = Path(__file__).resolve().parents[2]
# the idle window (3 s) outlasts the agents' lease keep-alive period (lease TTL 5 s / 3): since the
# index watches etcd instead of polling it, those keep-alives are the only idle etcd traffic, and a
# 1 s window saw none of them once (idle_etcd_rps 0.0, under load)
TINY = ["--agents", "2", "--seconds", "2", "--idle-seconds", "3", "--clients", "2", "--rate", "10", "--sessions", "8"]
ROW_KEYS = {
    "agents", "index_query_p99_ms", "event_lag_p99_ms", "index_memory_mib", "lookup_p50_ms", "lookup_p99_ms",
    "lock_p50_ms", "lock_p99_ms", "members_p99_ms", "master_cpu_s", "etcd_cpu_s", "master_rps", "etcd_rps",
    "idle_master_rps", "idle_etcd_rps", "master_rss_mib", "etcd_rss_mib", "agent_rss_mib", "ran_on", "pool",
    "calls_constant", "per_request_calls_seen", "cpu_saturated", "machine_busy", "requests", "achieved_rps",
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("scale")
    out = tmp / "scale.json"
    rc = scale.main([*TINY, "--out", str(out), "--state-dir", str(tmp / "state"), "--plot-dir", str(tmp / "plots")])
    return rc, json.loads(out.read_text()), tmp


def test_tiny_run_json_contract(tiny: tuple[int, dict[str, Any], Path]) -> None:
    rc, rep, tmp = tiny
    (row,) = rep["rows"]
    print(json.dumps(row, indent=1))  # shown when an assertion below fails
    assert rc == 0 and rep["benchmark"] == "bench.scale" and rep["correct"] is True
    assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
    assert row["agents"] == 2 and row["pool"] in ("netns", "loopback") and row["members_seen"] == [2]
    assert row["ran_on"]["hostname"] and row["ran_on"]["cores"] >= 1
    for k in ("lookup_p50_ms", "lookup_p99_ms", "lock_p50_ms", "lock_p99_ms", "members_p99_ms", "etcd_cpu_s"):
        assert isinstance(row[k], float) and row[k] > 0, k
    assert row["lookup_p50_ms"] <= row["lookup_p99_ms"] and row["master_cpu_s"] >= 0
    # the global index ran (`l3pool index`): each client an instance publishing KV events, queried per request
    assert rep["index"] == "on" and row["index_bad_messages"] == 0 and row["index_live_instances"] in (1, 2)
    for k in ("index_query_p50_ms", "index_query_p99_ms", "event_lag_p99_ms", "index_memory_mib", "index_cpu_s"):
        assert isinstance(row[k], float) and row[k] > 0, k
    assert row["index_memory_mib"] == pytest.approx(40.0 * 2**20 / 2**20, rel=0.01)  # 40 B/page x 1 Mi pages
    assert row["index_entries"] > 0 and row["index_hit_ratio"] > 0.75 and row["events_dropped_pages"] == 0
    assert 0 < row["event_messages_per_request"] <= 1.2  # batched: one message per request (+ idle heartbeats)
    # open loop: 2 clients x 10 req/s x 2 s, each request's calls counted; every one the same
    assert 36 <= row["requests"] <= 40 and row["put_failed"] == 0 and row["client_errors"] == 0
    want = calls_per_request(2, index=True)
    assert (want["master"], want["etcd_request_thread"], want["index"]) == (3, 6, 1)
    assert rep["calls_per_request"] == {**want, "etcd": 7}
    assert sum(row["per_request_calls_seen"].values()) == row["requests"]
    # master, etcd on the request thread, lease granted on it (0/1), index queries
    assert {(k.split(",")[0], k.split(",")[1], k.split(",")[3]) for k in row["per_request_calls_seen"]} == {
        ("3", "6", "1")
    }
    assert row["calls_constant"] is True and rep["targets"]["calls_constant"] is True
    assert row["leases_per_request"] == pytest.approx(1.0, abs=0.11)
    # the servers' own counters agree: each request costs the master its exists + a put start/end per stage
    assert 3 <= row["master_rpc_per_request"] <= 8 and row["etcd_rpc_per_request"] >= 6
    assert row["idle_master_rps"] > 0 and row["idle_etcd_rps"] > 0  # the agents' pings and keep-alives
    assert row["lookup_hit_ratio"] > 0.9  # the earlier turns' pages were found
    plots = sorted(Path(p).name for p in rep["plots"])
    assert plots == ["scale_cpu.png", "scale_latency.png", "scale_memory.png", "scale_rates.png"]
    assert all((tmp / "plots" / p).stat().st_size > 5000 for p in plots)


def test_a_request_with_one_call_more_breaks_the_constant(tiny: tuple[int, dict[str, Any], Path]) -> None:
    """The real clients' results of the tiny run, one request given an extra master call (and, apart,
    one that skipped its lease): `merge_clients` no longer calls the cost constant."""
    _, _, tmp = tiny
    results = [json.loads(p.read_text()) for p in sorted((tmp / "state" / "row-2").glob("client-*.json"))]
    results = [r for r in results if "per_request_calls" in r]
    assert len(results) == 2 and scale.merge_clients(results, 2, index=True)["calls_constant"] is True
    assert scale.merge_clients(results, 2, index=False)["calls_constant"] is False  # it made index queries
    key = next(iter(results[0]["per_request_calls"]))
    for extra in ("4," + key.split(",", 1)[1], key.rsplit(",", 1)[0] + ",2"):  # one master call more; two queries
        bad = json.loads(json.dumps(results))
        bad[0]["per_request_calls"][key] -= 1
        bad[0]["per_request_calls"][extra] = 1
        assert scale.merge_clients(bad, 2, index=True)["calls_constant"] is False, extra
    few = json.loads(json.dumps(results))
    few[0]["background_calls"]["lease"] = 0  # the leases stop matching the requests
    few[1]["background_calls"]["lease"] = 0
    assert scale.merge_clients(few, 2, index=True)["calls_constant"] is False


def test_the_counter_sees_an_extra_call_of_a_real_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process client against a real cluster: every request's calls are counted on the request
    thread; a join that makes one more etcd get on every second request shows up as another shape."""
    with LocalCluster(agents=1, segment_size="32MB", name=f"l3pt{uuid.uuid4().hex[:5]}",
                      state_dir=tmp_path / "c") as c:  # fmt: skip
        for k, v in c.client_env().items():
            monkeypatch.setenv(k, v)
        cfg = {
            "client": 0, "clients": 1, "tag": uuid.uuid4().hex[:8], "seed": 1, "master": c.master,
            "metadata": c.metadata_url, "etcd": c.etcd_endpoints, "host": c.client_host, "key_prefix": c.key_prefix,
            "stages": 3, "page_bytes": 1024, "trace": {"sessions": 2, "prefix_pages": 2, "new_pages": 2,
            "max_pages": 8}, "lock_ttl": 5, "seconds": 1, "rate": 10, "members_every_s": 0.2,
            "members_read": "members", "out": str(tmp_path / "r.json"),
        }  # fmt: skip
        client = Client(cfg)
        try:
            client.warm_up()
            client.run(time.time())
            honest = client.result()
            real_join = StageLocks.join

            def join_twice(self: StageLocks, request_id: str, *a: Any, **kw: Any) -> int:
                if self.stage == 1 and int(request_id.rsplit("-", 1)[1]) % 2:
                    self.etcd.get(self.lock_key(request_id))  # one etcd call more on odd requests
                return real_join(self, request_id, *a, **kw)

            monkeypatch.setattr(StageLocks, "join", join_twice)
            client.per_request.clear()
            client.run(time.time())
            dishonest = client.result()
        finally:
            client.close()
    want = calls_per_request(3)
    m, e = want["master"], want["etcd_request_thread"]
    assert (m, e) == (4, 9)
    shape = {tuple(k.split(",")[:2]) + tuple(k.split(",")[3:]) for k in honest["per_request_calls"]}
    assert shape == {(str(m), str(e), "0")}  # master, etcd, no index queries (no index in this client)
    assert 9 <= honest["requests"] <= 10 and honest["errors"] == 0 and honest["members_seen"] == [1]
    merged = scale.merge_clients([honest], 3)
    assert merged["calls_constant"] is True and merged["lookup_hit_ratio"] == 1.0
    # Metadata.members(): the range plus one lease-TTL call per member (1 member here)
    assert merged["etcd_calls_per_member_list"] == 2.0
    assert {tuple(k.split(",")[:2]) for k in dishonest["per_request_calls"]} == {(str(m), str(e)), (str(m), str(e + 1))}
    assert scale.merge_clients([dishonest], 3)["calls_constant"] is False


def test_trace_shares_the_prompt_grows_turns_and_restarts() -> None:
    spec = TraceSpec(sessions=4, prefix_pages=2, new_pages=3, max_pages=8)
    nss = scale_namespaces(2, "t", 1024)
    a, b = Trace(spec, nss, 0, 2, seed=7), Trace(spec, nss, 1, 2, seed=7)
    assert a.mine == [0, 2] and b.mine == [1, 3]
    h0, q0, k0, e0 = a.next()  # session 0, turn 0: prompt + 3 new pages, nothing expected yet
    _, _, kb, _ = b.next()
    assert q0.dtype == np.uint64 and q0.tolist() == [int.from_bytes(h[:8], "little") for h in h0]  # keys64
    assert len(h0) == len(k0[0]) == len(k0[1]) == 5 and e0 == 0
    assert k0[0][:2] == kb[0][:2] and k0[0][2:] != kb[0][2:]  # the prompt is shared across clients
    assert k0[1][0].startswith(nss[1].ns_id + "/") and k0[0][0] == f"{nss[0].ns_id}/{h0[0].hex()}"
    a.next()  # session 2
    _, _, k1, e1 = a.next()  # session 0, turn 1: its earlier pages again + 3 more
    assert len(k1[0]) == 8 and k1[0][:5] == k0[0] and e1 == 5
    a.next()
    h2, _, k2, e2 = a.next()  # session 0 would pass max_pages: a new session, same prompt
    assert len(k2[0]) == 5 and e2 == 0 and k2[0][:2] == k0[0][:2] and k2[0][2:] != k0[0][2:]
    assert all(len(h) == 16 for h in h2)
    raw = bytes(range(16)) + bytes(16)
    assert hex_keys("ns/", raw) == ["ns/" + raw[:16].hex(), "ns/" + raw[16:].hex()]  # trailing zeros kept


def test_l2_ring_pushes_out_the_oldest_keys() -> None:
    r = L2Ring(4)
    assert r.add(np.array([1, 2, 3], np.uint64)).tolist() == [] and r.held().tolist() == [1, 2, 3]
    assert r.add(np.array([4, 5], np.uint64)).tolist() == [1]
    assert sorted(r.held().tolist()) == [2, 3, 4, 5]
    assert r.add(np.array([6, 7, 8], np.uint64)).tolist() == [2, 3, 4]
    seen = []
    assert sorted(r.contents(lambda: seen.append(1))["l2"].tolist()) == [5, 6, 7, 8] and seen == [1]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--agents", "0"], "agent counts must be in [1, 200]"),
        (["--agents", "8,x"], "expected agent counts"),
        (["--seconds", "0"], "must be > 0"),
        (["--prefix-pages", "200"], "max_pages must hold"),
        (["--segment-size", "1MB"], "below Mooncake's minimum"),
        (["--agents", "200", "--segment-size", "1TB"], "lower --agents or --segment-size"),
        (["--merge", "/nonexistent/a.json"], "--merge /nonexistent/a.json"),
        (["--agents", "8,16,32,64", "--max-minutes", "0.5"], "over --max-minutes"),
    ],
)
def test_bad_input_is_one_error_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = guarded("python -m bench.scale", lambda: scale.main(argv), json_errors=False)
    except SystemExit as e:  # argparse's own refusal (usage + one error line, exit 2)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err, err


def test_merge_rejects_other_reports_and_joins_rows(tiny: tuple[int, dict[str, Any], Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    _, rep, _ = tiny
    other = tmp_path / "l3.json"
    other.write_text(json.dumps({"benchmark": "bench.l3", "rows": []}))
    rc = guarded("python -m bench.scale", lambda: scale.main(["--merge", str(other)]), json_errors=False)
    assert rc == 2 and "not a bench.scale report" in capsys.readouterr().err
    big = json.loads(json.dumps(rep))
    big["rows"][0] |= {"agents": 64, "ran_on": {**big["rows"][0]["ran_on"], "hostname": "gpu-host"}}
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    a.write_text(json.dumps(rep))
    b.write_text(json.dumps(big))
    assert scale.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert [r["agents"] for r in m["rows"]] == [2, 64] and m["ran_on"] == sorted({"gpu-host", rep["ran_on"][0]})
    assert m["calls_per_request"] == rep["calls_per_request"] and len(m["config"]["merged_from"]) == 2
    assert m["targets"]["lookup_p99_growth"] == {}  # one row per machine: no growth is claimed across machines


def _ours(marker: str) -> list[int]:
    """Pids whose working directory lies under `marker` (the cluster's and the clients' cwd)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.readlink(f"/proc/{d}/cwd").startswith(marker):
                    pids.append(int(d))
            except OSError:
                continue
    return pids


def _down_leftovers(state: Path) -> None:
    """A run the test had to kill leaves its clusters up (they run in sessions of their own): each
    cluster recorded under `state` is stopped (processes and network namespaces), so a failure of
    this test leaks nothing into the rest of the suite (seen: etcd, master and 2 agents left running)."""
    env = python_env()  # the parent's PYTHONPATH too: Mooncake may come from a bundle on it (GPU host)
    for st in state.rglob("state.json"):
        subprocess.run([sys.executable, "-m", "l3pool.cli", "cluster", "down", "--state-dir", str(st.parent)],
                       cwd=ROOT, env=env, capture_output=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    ("sig", "code", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_ctrl_c_or_sigterm_tears_everything_down(tmp_path: Path, sig: int, code: int, word: str) -> None:
    state = tmp_path / "state"
    netns = os.geteuid() == 0 and shutil.which("ip") is not None  # else the cluster runs on loopback
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if netns else ""
    env = python_env()  # the parent's PYTHONPATH too: Mooncake may come from a bundle on it (GPU host)
    p = subprocess.Popen(
        [sys.executable, "-m", "bench.scale", "--agents", "2", "--seconds", "60", "--idle-seconds", "1",
         "--clients", "1", "--state-dir", str(state)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
    )  # fmt: skip
    try:
        assert p.stderr is not None
        deadline = time.monotonic() + 90
        seen = []
        for line in p.stderr:
            seen.append(line)
            if "loaded window" in line or time.monotonic() > deadline:
                break
        assert _ours(str(state)), f"the run should have processes up by now (exit {p.poll()}):\n{''.join(seen)[-3000:]}"
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
            _down_leftovers(state)
    assert p.returncode == code and word in err, err[-2000:]
    deadline = time.monotonic() + 10
    while _ours(str(state)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ours(str(state)) == []
    if netns:
        after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert {x for x in after.split() if x.startswith("l3ps")} <= set(before.split())
