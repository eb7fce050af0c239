"""Fault tests against a real `l3pool index` process (a subprocess serving a real etcd's sources):
hostile event messages from a registered source, hostile queries, one connection flooding the
query port. Each test checks the process survives, counts what it refused, and that nothing of
the bad input reached another source or the index's state."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest

from l3pool.index.client import IndexClient, IndexRequestError, IndexUnavailable
from l3pool.index.queries import QueryServer, frame, parse_endpoint
from l3pool.pool import kv_events as kv
from l3pool.pool.etcd import LeaseKeeper
from l3pool.pool.metadata import Metadata
from l3pool.procenv import python_env

from ..conftest import EtcdServer, free_port
from .test_index_service import Instance

KEYS = list(range(1, 41))


@dataclass
class IndexProc:
    proc: subprocess.Popen[str]
    endpoint: str
    insts: list[Instance]

    def status(self) -> dict[str, Any]:
        with IndexClient(self.endpoint, timeout_s=5.0) as c:
            return c.status()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

    def live(self, iid: str) -> bool:
        return bool(self.status()["instances"].get(iid, {}).get("live"))

    def answered(self, inst: Instance) -> bool:
        with IndexClient(self.endpoint, timeout_s=5.0) as c:
            return c.query(np.array(KEYS, np.uint64), inst.ns).of(inst.iid) == inst.truth(KEYS)


def start_index(etcd: EtcdServer, prefix: str, *extra: str) -> subprocess.Popen[str]:
    """`l3pool index` serving `prefix` of `etcd` (its first stdout line: the endpoint, JSON)."""
    return subprocess.Popen(
        [sys.executable, "-m", "l3pool.cli", "index", "--etcd", etcd.endpoints, "--key-prefix", prefix,
         "--listen", f"tcp://127.0.0.1:{free_port()}", "--capacity-pages", "10000", "--poll", "0.2", "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env(),
    )  # fmt: skip


def wait_for(fn: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if fn():
                return
        except IndexUnavailable:
            pass
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {fn}")


@pytest.fixture
def index_proc(etcd_server: EtcdServer, prefix: str) -> Iterator[IndexProc]:
    """A real `l3pool index` with two scripted sources registered in etcd, both live, each holding
    KEYS[:5] in L1."""
    c = etcd_server.client()
    md = Metadata(c, prefix)
    insts = [Instance("src-a"), Instance("src-b")]
    keepers: list[LeaseKeeper] = []
    proc = start_index(etcd_server, prefix)
    try:
        assert proc.stdout is not None
        endpoint = json.loads(proc.stdout.readline())["endpoint"]
        ip = IndexProc(proc, endpoint, insts)
        for i in insts:
            i.event((0, 1, KEYS[:5]))
            keepers.append(md.register_kv_source(i.info(), ttl=10))
        wait_for(lambda: all(ip.live(i.iid) for i in insts))
        time.sleep(0.3)  # the SUB's subscriptions reach the PUBs (ZeroMQ's slow joiner)
        yield ip
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for k in keepers:
            k.close(revoke=True)
        for i in insts:
            i.close()
        c.delete_prefix(prefix + "/")
        c.close()


def _event(inst: Instance, ops: list[int], keys: bytes, sent_at: Any = None, ns: Any = None) -> bytes:
    """A message of `inst` with its next seq (what a broken or hostile publisher might send)."""
    inst.seq += 1
    sent = time.time() if sent_at is None else sent_at
    return msgpack.packb([1, "ev", inst.iid, inst.epoch, inst.seq, inst.ns if ns is None else ns, ops, keys, sent])


def _counters(st: dict[str, Any], iid: str) -> tuple[int, int, int]:
    d = st["instances"][iid]
    return d["resyncs"], d["gaps"], d["events"]


def _bad_message_leaves_the_rest_alone(ip: IndexProc, msg: bytes) -> dict[str, Any]:
    """Send `msg` from src-a; the index survives, counts it, src-b is untouched (no resync, no
    gap), src-a heals by its own resync, and the answers are both sources' truth."""
    a, b = ip.insts
    before = ip.status()
    a.send(msg)
    b.send(b.event((1, 1, KEYS[5:9])))  # the other source goes on
    wait_for(lambda: ip.status()["instances"]["src-b"]["seq"] == b.seq)
    a.send(a.event((0, 1, KEYS[5:7])))  # src-a's next one: a gap after the refused one, so a resync
    wait_for(lambda: ip.answered(a) and ip.answered(b) and ip.live("src-a"))
    assert ip.alive(), ip.proc.stderr.read() if ip.proc.stderr else ""
    after = ip.status()
    assert after["bad_messages"] == before["bad_messages"] + 1
    assert after["loop_errors"] == 0
    rb, gb, eb = _counters(before, "src-b")
    assert _counters(after, "src-b") == (rb, gb, eb + 1)  # one event more, no resync, no gap
    assert after["instances"]["src-a"]["resyncs"] == before["instances"]["src-a"]["resyncs"] + 1
    return after


# -- D1: counts that wrap around 64 bits ----------------------------------------------------------
WRAP_OPS = [0, 1, 1 << 62] * 4 + [0, 1, 1]  # 4 * 2^62 + 1 == 1 (mod 2^64): one key's worth


def test_wrapped_op_counts_are_refused_by_the_decoder() -> None:
    msg = msgpack.packb([1, "ev", "i", 1, 1, "", WRAP_OPS, b"\1" * 8, 0.0])
    with pytest.raises(kv.WireError, match="ops name 4611686018427387904 keys in one op, 1 given"):
        kv.decode_events(msg)
    # counts that sum to the keys only modulo 2^64, none alone above them: refused by their sum
    n = 1 << 20
    msg = msgpack.packb([1, "ev", "i", 1, 1, "", [0, 1, n] * 4, b"\1" * 8 * n, 0.0])
    with pytest.raises(kv.WireError, match=f"ops name {4 * n} keys, {n} given"):
        kv.decode_events(msg)


_NATIVE_WRAP = """
import numpy as np
from l3pool.index.table import GlobalIndex
ops = np.array({ops}, dtype=np.int64).reshape(-1, 3)
keys = np.ones(1, np.uint64)
gi = GlobalIndex(1000)
gi.add_instance("a")
for call in (lambda: gi.apply("a", "", ops, keys), lambda: gi.native.apply(0, ops, keys, 0, 1)):
    try:
        call()
    except ValueError as e:
        print("refused:", e, flush=True)
gi.check()
print("entries", gi.stats()["entries"])
"""


def test_wrapped_op_counts_are_refused_by_the_table_and_the_native_call() -> None:
    """GlobalIndex.apply and KvIndex.apply itself (no Python check before it) with counts that wrap
    around to the key count: before, the native loop read 2^62 keys of a 1-key buffer (SIGSEGV:
    run in a subprocess so the suite survives)."""
    code = _NATIVE_WRAP.format(ops=WRAP_OPS)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert lines[0] == "refused: ops name 4611686018427387904 keys in one op, 1 given", lines
    assert lines[1] == "refused: ops name more keys than the 1 given: op 0 names 4611686018427387904, 1 left", lines
    assert lines[2] == "entries 0"


@pytest.mark.usefixtures("index_native")
def test_a_wrapping_message_from_a_registered_source_is_one_bad_message(index_proc: IndexProc) -> None:
    """Before: the `l3pool index` process died of SIGSEGV on this message."""
    after = _bad_message_leaves_the_rest_alone(index_proc, _event(index_proc.insts[0], WRAP_OPS, b"\1" * 8))
    assert after["index"]["entries"] == 9  # KEYS[:9]: nothing of the bad message


# -- D2: an op integer of 2^63 or more --------------------------------------------------------------
@pytest.mark.parametrize("ops", [[0, 1, 1 << 63], [(1 << 64) - 1, 1, 1], [0, 1 << 63, 1]])
def test_an_op_integer_beyond_int64_is_a_wire_error(ops: list[int]) -> None:
    msg = msgpack.packb([1, "ev", "i", 1, 1, "", ops, b"\1" * 8, 0.0])
    with pytest.raises(kv.WireError, match="int64 range"):
        kv.decode_events(msg)


@pytest.mark.usefixtures("index_native")
def test_an_op_beyond_int64_touches_no_other_source(index_proc: IndexProc) -> None:
    """Before: OverflowError out of the decoder, the loop's catch-all resynchronised every source."""
    _bad_message_leaves_the_rest_alone(index_proc, _event(index_proc.insts[0], [0, 1, 1 << 63], b"\1" * 8))


# -- D3: namespaces are bounded, and a bad query leaves nothing behind ---------------------------
def test_namespaces_are_bounded_on_the_wire_and_in_the_salt_cache() -> None:
    ok, long_ = "é" * (kv.MAX_NAMESPACE // 2), "é" * (kv.MAX_NAMESPACE // 2) + "x"
    assert kv.check_namespace(ok) == ok
    for bad in (long_, "x" * (1 << 20), 5, None):
        with pytest.raises(kv.WireError, match="namespace"):
            kv.check_namespace(bad)
    with pytest.raises(kv.WireError, match="namespace longer than 256 bytes"):
        kv.decode_events(msgpack.packb([1, "ev", "i", 1, 1, long_, [], b"", 0.0]))
    with pytest.raises(kv.WireError, match="namespace longer"):
        kv.decode_snapshot(kv.encode_snapshot("i", 1, 1, "x" * 300, {}))


@pytest.mark.usefixtures("index_native")
def test_the_salt_cache_keeps_the_last_namespaces_of_changes_and_none_of_queries() -> None:
    from l3pool.index.table import SALT_CACHE, GlobalIndex, salt

    gi = GlobalIndex(10_000)
    gi.add_instance("a")
    gi.set_live("a", True)
    k = np.arange(1, 4, dtype=np.uint64)
    for i in range(SALT_CACHE + 50):
        gi.apply("a", f"ns{i}", np.array([[0, 1, 3]], np.int64), k)
    assert gi.stats()["namespaces_cached"] == SALT_CACHE
    assert "ns0" not in gi._salts and gi._salts[f"ns{SALT_CACHE + 49}"] == salt(f"ns{SALT_CACHE + 49}")
    assert gi.query(k, "ns0").of("a").l1 == 3  # evicted from the cache, still answered right
    for i in range(3000):
        gi.query(k, f"q{i}")
    assert gi.stats()["namespaces_cached"] == SALT_CACHE and not any(n.startswith("q") for n in gi._salts)
    queries = gi.queries
    with pytest.raises(ValueError, match="namespace longer"):
        gi.query(k, "x" * (1 << 20))
    with pytest.raises(ValueError, match="namespace longer"):
        gi.apply("a", "x" * 300, np.array([[0, 1, 3]], np.int64), k)
    assert gi.queries == queries and gi.stats()["namespaces_cached"] == SALT_CACHE


@pytest.mark.usefixtures("index_native")
def test_huge_namespaces_do_not_grow_the_index_process(index_proc: IndexProc) -> None:
    """Before: 64 queries naming a 1 MiB namespace each grew the process by 67 MiB (cached
    forever); now each is one refused request, nothing kept."""
    before, rss0 = index_proc.status(), index_proc.rss()
    with IndexClient(index_proc.endpoint, timeout_s=5.0) as c:
        for i in range(64):
            with pytest.raises(IndexRequestError, match="namespace longer"):
                c.query(np.arange(1, 5, dtype=np.uint64), chr(65 + i % 26) * (1 << 20))
        for i in range(500):  # valid but never seen: answered, not kept
            assert c.query(np.arange(1, 5, dtype=np.uint64), f"q{i}").pages == 4
    grown = index_proc.rss() - rss0
    after = index_proc.status()
    assert grown < 16 << 20, f"grew by {grown / 2**20:.1f} MiB"
    assert after["bad_messages"] == before["bad_messages"] + 64
    assert after["index"]["queries"] == before["index"]["queries"] + 500  # the refused ones not counted
    assert after["index"]["namespaces_cached"] == before["index"]["namespaces_cached"]


@pytest.mark.usefixtures("index_native")
def test_an_event_with_a_huge_namespace_is_one_bad_message(index_proc: IndexProc) -> None:
    a = index_proc.insts[0]
    after = _bad_message_leaves_the_rest_alone(index_proc, _event(a, [0, 1, 1], b"\1" * 8, ns="n" * (1 << 20)))
    assert after["index"]["namespaces_cached"] == 1  # "ns", the sources' own


# -- D4: a non-finite sent_at -----------------------------------------------------------------------
@pytest.mark.parametrize("sent_at", [math.nan, math.inf, -math.inf])
def test_a_non_finite_sent_at_is_a_wire_error(sent_at: float) -> None:
    with pytest.raises(kv.WireError, match="sent_at must be a finite number"):
        kv.decode_events(msgpack.packb([1, "ev", "i", 1, 1, "", [], b"", sent_at]))


@pytest.mark.usefixtures("index_native")
def test_a_non_finite_sent_at_leaves_the_lag_statistics_finite(index_proc: IndexProc) -> None:
    """Before: the NaN was sampled and the event lag's p50 and p99 read NaN."""
    a = index_proc.insts[0]
    after = _bad_message_leaves_the_rest_alone(index_proc, _event(a, [0, 1, 1], b"\1" * 8, sent_at=math.nan))
    lag = after["event_lag_ms"]
    assert lag["samples"] >= 1 and math.isfinite(lag["p50"]) and math.isfinite(lag["p99"]), lag


# -- D6: connections served fairly; bad frames counted ------------------------------------------------
def _recv_frames(s: socket.socket, n: int, timeout: float = 30.0) -> list[bytes]:
    s.settimeout(timeout)
    buf, out = bytearray(), []
    while len(out) < n:
        chunk = s.recv(1 << 20)
        assert chunk, f"closed after {len(out)} answers"
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + (k := int.from_bytes(buf[:4], "little")):
            out.append(bytes(buf[4 : 4 + k]))
            del buf[: 4 + k]
    return out


def test_the_query_server_answers_one_request_of_each_connection_per_turn() -> None:
    """A QueryServer (real sockets) whose answer function records the order: one connection's
    3,000 pipelined requests and another's one, both buffered before the first is answered.
    Before: the other's came 3,001st (every buffered request of a connection was answered in
    one go); now second."""
    order: list[bytes] = []
    first, go = threading.Event(), threading.Event()

    def answer(body: bytes) -> bytes:
        if not order:
            first.set()
            go.wait(10)  # the other client's request is in meanwhile
        order.append(body[:1])
        return b"ok"

    srv = QueryServer("tcp://127.0.0.1:0", answer).start()
    host, port = parse_endpoint(srv.endpoint)
    flood, other = socket.create_connection((host, port)), socket.create_connection((host, port))
    try:
        flood.sendall(frame(b"F") * 3000)
        assert first.wait(10)
        other.sendall(frame(b"O"))
        time.sleep(0.2)  # in the server's socket buffer
        go.set()
        assert _recv_frames(other, 1) == [b"ok"]
        assert len(_recv_frames(flood, 3000)) == 3000
    finally:
        go.set()
        flood.close()
        other.close()
        srv.close()
    assert len(order) == 3001 and order.index(b"O") <= 2, order.index(b"O")
    assert srv.requests == 3001 and srv.bad_frames == 0


@pytest.mark.usefixtures("index_native")
def test_pipelining_connections_do_not_hold_the_others(index_proc: IndexProc) -> None:
    """Four connections pipelining 3,000 status requests each, another client's queries meanwhile.
    Before: the queries waited for every buffered status answer (a turn of the server answered
    all of a connection's buffered requests: max 110-170 ms here); now for one per connection."""
    port = int(index_proc.endpoint.rsplit(":", 1)[1])
    floods = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    keys = np.array(KEYS, np.uint64)
    waits = []
    try:
        with IndexClient(index_proc.endpoint, timeout_s=5.0) as c:
            c.query(keys, "ns")  # connected
            for f in floods:
                f.sendall(frame(kv.encode_request("status")) * 3000)
            for _ in range(20):
                t0 = time.perf_counter()
                assert c.query(keys, "ns").of("src-a").l1 == 5
                waits.append(time.perf_counter() - t0)
        answers = [_recv_frames(f, 3000) for f in floods]  # every one answered, none lost
    finally:
        for f in floods:
            f.close()
    assert all([kv.decode_request(a)[0] for a in ans] == ["ok"] * 3000 for ans in answers)
    print(f"query latency behind 4 x 3,000 pipelined status requests: max {max(waits) * 1e3:.1f} ms, "
          f"first {waits[0] * 1e3:.1f} ms")  # fmt: skip
    # the order itself is proven by test_the_query_server_answers_one_request_of_each_connection_per_turn;
    # this bounds the latency loosely (the first query's 60 ms on the H200 host under -n 8 was that
    # machine's load), still below the 174-178 ms it waited here before the fix
    assert max(waits) < 0.15, [round(w * 1e3, 1) for w in waits]


@pytest.mark.usefixtures("index_native")
def test_a_closed_bad_frame_is_counted_in_status(index_proc: IndexProc) -> None:
    before = index_proc.status()
    port = int(index_proc.endpoint.rsplit(":", 1)[1])
    for head in ((1 << 31).to_bytes(4, "little"), b"\xff\xff\xff\xff"):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + b"junk")
        s.settimeout(5)
        assert s.recv(16) == b""  # closed by the index
        s.close()
    after = index_proc.status()
    assert after["bad_frames"] == before.get("bad_frames", 0) + 2
    assert after["bad_messages"] == before["bad_messages"] + 2


# -- D5: a routing decision within 50 ms, whatever the index does ---------------------------------
def _stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (state T)."""
    states = []
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(s in ("T", "t") for s in states)


@pytest.mark.usefixtures("index_native")
def test_a_routing_decision_takes_at_most_50_ms_with_the_index_stopped(index_proc: IndexProc) -> None:
    """The real `l3pool index` SIGSTOPped: a router asking through GuardedIndex decides within
    50 ms every time (before, through IndexClient: the client's whole timeout, 1 s by default),
    on the last known answer of a request it asked before, on load alone for a new one, the
    source and reason on the answer; SIGCONT: the index's own answers again."""
    from l3pool.index.guard import GuardedIndex
    from l3pool.router.router import Router

    pid, keys, new = index_proc.proc.pid, np.array(KEYS, np.uint64), np.array(KEYS[::-1], np.uint64)
    router = Router("cache_aware", ["src-a", "src-b"], page_size=16, page_bytes=1 << 16)
    guard = GuardedIndex(index_proc.endpoint, deadline_s=0.03, cooldown_s=0.3)
    n = [0]

    def decide(k: np.ndarray) -> tuple[Any, Any, float]:
        n[0] += 1
        t0 = time.perf_counter()
        hits = guard.query(k, "ns")
        d = router.route(f"r{n[0]}", tokens=16 * len(k), hits=hits)
        took = time.perf_counter() - t0
        router.finished(d.request_id)
        return hits, d, took

    hits, d, _ = decide(keys)
    assert hits.source == "index" and hits.of("src-a").l1 == 5 and d.chosen.l1 == 5
    plain = IndexClient(index_proc.endpoint)  # what a router had: the client's own 1 s timeout
    plain.query(keys, "ns")
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        wait_for(lambda: _stopped(pid), 5)  # every thread (a group stop is not done when kill returns)
        with pytest.raises(IndexUnavailable, match="within 1000 ms"):
            plain.query(keys, "ns")
        assert time.perf_counter() - t0 >= 0.99
        took, seen = [], set()
        end = time.monotonic() + 1.5  # probes (one deadline each) after 0.3 s and 0.6 s more: doubling
        while time.monotonic() < end:
            for k, source in ((keys, "last_known"), (new, "none")):
                hits, d, t = decide(k)
                took.append(t)
                assert hits.source == source and hits.pages == len(k), hits
                assert "did not answer within 30 ms" in hits.reason or "breaker open" in hits.reason
                seen.add(hits.reason.split(" ", 2)[1])
                if source == "last_known":
                    assert hits.of("src-a").l1 == 5 and d.chosen.l1 == 5  # priced as it was known
                else:
                    assert d.chosen.l1 == d.chosen.l2 == d.chosen.l3 == 0  # load only
            time.sleep(0.005)
        st = guard.stats()
        print(f"{len(took)} decisions with the index stopped: max {max(took) * 1e3:.1f} ms, "
              f"p50 {sorted(took)[len(took) // 2] * 1e3:.2f} ms; {st['probes']} probes")  # fmt: skip
        assert max(took) <= 0.05, sorted(took)[-5:]
        assert st["breaker"] in ("open", "probing") and 2 <= st["probes"] <= 3 and st["opened"] == 1
        assert seen == {"index", "open"}  # "the index at ... did not answer", "breaker open (...)"
    finally:
        os.kill(pid, signal.SIGCONT)
        plain.close()
    wait_for(lambda: guard.query(keys, "ns").source == "index", 5)
    assert guard.stats()["breaker"] == "closed" and index_proc.alive()
    guard.close()
