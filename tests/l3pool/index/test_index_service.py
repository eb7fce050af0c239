"""IndexService over real ZeroMQ sockets on 127.0.0.1: an instance that speaks the wire protocol
under the test's control (it can lose, repeat and reorder its messages, restart, go silent) and
the index's answers checked against that instance's true state after every fault."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from l3pool.index.client import IndexClient, IndexRequestError, IndexUnavailable
from l3pool.index.service import IndexService
from l3pool.index.table import GlobalIndex
from l3pool.index.types import TierPrefix
from l3pool.pool import kv_events as kv

pytestmark = pytest.mark.usefixtures("index_native")


def eventually(fn: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {fn}")


class Instance:
    """An engine instance's KV-event side, scripted: `event()` changes its state and returns the
    message it would send; `send()` sends one (or not: a loss); snapshots are served from a
    thread, exactly as of the last seq."""

    def __init__(self, iid: str, namespace: str = "ns") -> None:
        self.iid, self.ns, self.epoch, self.seq = iid, namespace, kv.new_epoch(), 0
        self.tiers: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
        self.mu = threading.Lock()
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.rtr = ctx.socket(zmq.ROUTER)
        self.rtr.setsockopt(zmq.LINGER, 0)
        self.rtr.bind("tcp://127.0.0.1:*")
        self.snapshots = 0
        self.serving = True
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def info(self) -> kv.SourceInfo:
        ep = lambda s: s.getsockopt(zmq.LAST_ENDPOINT).decode()  # noqa: E731
        return kv.SourceInfo(self.iid, ep(self.pub), ep(self.rtr), self.ns, self.epoch)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.rtr.poll(20):
                continue
            frames = self.rtr.recv_multipart()
            if not self.serving:
                continue  # a wedged instance: never answers
            with self.mu:
                tiers = {n: np.array(sorted(self.tiers[i]), dtype=np.uint64) for i, n in enumerate(kv.TIER_NAMES)}
                body = kv.encode_snapshot(self.iid, self.epoch, self.seq, self.ns, tiers)
                self.snapshots += 1
            self.rtr.send_multipart([*frames[:-1], body])

    def event(self, *ops: tuple[int, int, list[int]]) -> bytes:
        with self.mu:
            for tier, op, keys in ops:
                (self.tiers[tier].update if op else self.tiers[tier].difference_update)(keys)
            self.seq += 1
            flat = [x for t, o, k in ops for x in (t, o, len(k))]
            keys_b = np.array([x for _, _, k in ops for x in k], dtype="<u8").tobytes()
            return kv.encode_events(self.iid, self.epoch, self.seq, self.ns, flat, keys_b)

    def heartbeat(self) -> bytes:
        return kv.encode_events(self.iid, self.epoch, self.seq, self.ns, [], b"")

    def send(self, msg: bytes) -> None:
        self.pub.send(msg)

    def restart(self) -> None:
        with self.mu:
            self.epoch, self.seq = kv.new_epoch(), 0
            self.tiers = {0: set(), 1: set(), 2: set()}

    def truth(self, keys: list[int]) -> TierPrefix:
        def run(*sets: set[int]) -> int:
            n = 0
            for k in keys:
                if not any(k in s for s in sets):
                    break
                n += 1
            return n

        t = self.tiers
        return TierPrefix(run(t[0]), run(t[0], t[1]), run(t[0], t[1], t[2]))

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.pub.close()
        self.rtr.close()


@pytest.fixture
def inst() -> Iterator[Instance]:
    i = Instance("inst-a")
    yield i
    i.close()


@pytest.fixture
def svc() -> Iterator[IndexService]:
    s = IndexService(GlobalIndex(10_000), snapshot_timeout_s=0.5, retry_s=0.1, silent_s=60).start()
    yield s
    s.close()


KEYS = list(range(1, 41))


def _matches(svc: IndexService, inst: Instance) -> bool:
    if inst.iid not in svc.index.instances():
        return False
    return svc.index.query(np.array(KEYS, dtype=np.uint64), inst.ns).of(inst.iid) == inst.truth(KEYS)


def _join(svc: IndexService, inst: Instance) -> None:
    svc.set_sources({inst.iid: inst.info()})
    assert svc.wait_live([inst.iid], 10)
    time.sleep(0.2)  # the SUB's subscription reaches the PUB (ZeroMQ's slow joiner)


def _st(svc: IndexService, iid: str) -> dict[str, Any]:
    """The instance's status row (zeros until the index knows it)."""
    d = dict.fromkeys(("seq", "resyncs", "gaps", "duplicates", "epochs"), 0) | {"last_error": ""}
    return d | svc.status()["instances"].get(iid, {})


def test_events_apply_in_order(svc: IndexService, inst: Instance) -> None:
    inst.event((0, 1, KEYS[:5]))  # before the index knew it: in the snapshot
    _join(svc, inst)
    inst.send(inst.event((0, 1, KEYS[5:10]), (1, 1, KEYS[:20])))
    inst.send(inst.event((2, 1, KEYS[:30]), (0, 0, KEYS[8:10])))
    eventually(lambda: _matches(svc, inst) and _st(svc, inst.iid)["seq"] == 3)
    assert svc.index.query(np.array(KEYS, dtype=np.uint64), "ns").of("inst-a") == TierPrefix(8, 20, 30)
    assert _st(svc, inst.iid)["resyncs"] == 1 and _st(svc, inst.iid)["gaps"] == 0


def test_a_lost_event_is_healed_by_resync(svc: IndexService, inst: Instance) -> None:
    _join(svc, inst)
    inst.send(inst.event((0, 1, KEYS[:10])))
    inst.event((0, 0, KEYS[:3]), (1, 1, KEYS[:3]))  # lost on the way
    inst.send(inst.event((1, 1, KEYS[10:20])))
    eventually(lambda: _st(svc, inst.iid)["gaps"] >= 1 and _matches(svc, inst))
    assert svc.index.query(np.array(KEYS, dtype=np.uint64), "ns").of("inst-a") == TierPrefix(0, 20, 20)
    assert _st(svc, inst.iid)["resyncs"] >= 2 and inst.snapshots >= 2


def test_a_lost_last_event_is_seen_by_the_heartbeat(svc: IndexService, inst: Instance) -> None:
    _join(svc, inst)
    inst.event((0, 1, KEYS[:10]))  # lost, and nothing follows but heartbeats
    inst.send(inst.heartbeat())
    eventually(lambda: _matches(svc, inst) and svc.index.query(np.array(KEYS, np.uint64), "ns").of("inst-a").l1 == 10)


def test_duplicates_and_reordering_resync(svc: IndexService, inst: Instance) -> None:
    _join(svc, inst)
    m1 = inst.event((0, 1, KEYS[:10]))
    inst.send(m1)
    eventually(lambda: _st(svc, inst.iid)["seq"] == 1)
    inst.send(m1)  # a duplicate
    eventually(lambda: _st(svc, inst.iid)["duplicates"] >= 1 and _matches(svc, inst))
    m2 = inst.event((0, 0, KEYS[:10]))
    m3 = inst.event((0, 1, KEYS[:4]))
    inst.send(m3)  # reordered: 3 before 2
    inst.send(m2)
    eventually(lambda: _st(svc, inst.iid)["gaps"] >= 1 and _matches(svc, inst) and _st(svc, inst.iid)["seq"] == 3)
    assert svc.index.query(np.array(KEYS, np.uint64), "ns").of("inst-a") == TierPrefix(4, 4, 4)


def test_an_instance_restart_is_a_new_epoch(svc: IndexService, inst: Instance) -> None:
    _join(svc, inst)
    inst.send(inst.event((0, 1, KEYS[:10])))
    eventually(lambda: _matches(svc, inst) and _st(svc, inst.iid)["seq"] == 1)
    inst.restart()
    inst.send(inst.event((1, 1, KEYS[:2])))
    eventually(lambda: _st(svc, inst.iid)["epochs"] >= 1 and _matches(svc, inst))
    assert svc.index.query(np.array(KEYS, np.uint64), "ns").of("inst-a") == TierPrefix(0, 2, 2)


def test_malformed_and_unknown_messages_are_counted_and_dropped(svc: IndexService, inst: Instance) -> None:
    _join(svc, inst)
    inst.send(inst.event((0, 1, KEYS[:5])))
    eventually(lambda: _st(svc, inst.iid)["seq"] == 1)
    inst.send(b"\xc1not msgpack")
    inst.send(kv.encode_events("stranger", 1, 1, "ns", [0, 1, 1], b"\1" * 8))
    eventually(lambda: svc.status()["bad_messages"] >= 1 and svc.status()["unknown_messages"] >= 1)
    assert _matches(svc, inst) and _st(svc, inst.iid)["resyncs"] == 1  # nothing else disturbed


def test_a_silent_snapshot_endpoint_is_never_answered_for(svc: IndexService, inst: Instance) -> None:
    inst.serving = False
    inst.event((0, 1, KEYS[:5]))
    svc.set_sources({inst.iid: inst.info()})
    eventually(lambda: "no snapshot" in _st(svc, inst.iid)["last_error"], 5)
    assert svc.index.query(np.array(KEYS, np.uint64), "ns").per_instance == {}
    inst.serving = True  # it comes back: retried, then answered
    eventually(lambda: _matches(svc, inst))


def test_dead_endpoints_and_leaving_sources(svc: IndexService, inst: Instance) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there
    dead = kv.SourceInfo("dead", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port}", "ns", 1)
    inst.event((0, 1, KEYS[:5]))
    svc.set_sources({"dead": dead, inst.iid: inst.info()})
    eventually(lambda: _matches(svc, inst))
    eventually(lambda: "no snapshot" in _st(svc, "dead")["last_error"], 5)
    assert set(svc.index.query(np.array(KEYS, np.uint64), "ns").per_instance) == {"inst-a"}
    svc.set_sources({"dead": dead})  # inst-a's registration ended
    eventually(lambda: "inst-a" not in svc.status()["instances"])
    assert svc.index.query(np.array(KEYS, np.uint64), "ns").per_instance == {}  # out of the answers at once
    eventually(lambda: svc.index.stats()["entries"] == 0)  # swept in parts right after (table.py)


def test_client_queries_status_and_errors(svc: IndexService, inst: Instance) -> None:
    inst.event((0, 1, KEYS[:7]), (2, 1, KEYS[:9]))
    _join(svc, inst)
    hs = [k.to_bytes(8, "little") + b"\0" * 8 for k in KEYS]  # 16-byte hashes whose first 8 bytes are the keys
    with IndexClient(svc.endpoint, timeout_s=2.0) as c:
        h = c.query(hs, "ns")
        assert h == svc.index.query(hs, "ns") and h.of("inst-a") == TierPrefix(7, 7, 9) and h.pool_l3 == 9
        assert c.status()["instances"]["inst-a"]["live"] is True
        kv_rep = kv.decode_request(c._roundtrip(kv.encode_request("query", "ns", b"\0" * 7)))
        assert kv_rep[0] == "err" and "8-byte keys" in kv_rep[1]
        with pytest.raises(IndexRequestError, match="unknown request"):
            c._call("drop_everything")
        with pytest.raises(ValueError):
            c.query([b"short"])
        assert c.query([], "ns").pages == 0
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t0 = time.monotonic()
    with IndexClient(f"tcp://127.0.0.1:{port}", timeout_s=0.3) as c, pytest.raises(IndexUnavailable):
        c.query(hs)
    assert time.monotonic() - t0 < 2
    with pytest.raises(ValueError, match="endpoint"):
        IndexClient("localhost:1")


def test_publisher_drops_are_healed_by_resync(svc: IndexService) -> None:
    """A real KvEventPublisher whose queue overflows (drops counted, the caller never blocked):
    the index sees the skipped seq, resynchronises from the publisher's snapshot and ends with the
    true state."""
    from l3pool.cache.events import KvEventPublisher

    mu = threading.RLock()  # the "cache lock": state changes and their events happen under it
    held: set[int] = set()

    def contents(under_lock: Callable[[], None] | None) -> dict[str, np.ndarray]:
        with mu:
            out = {"l1": np.array(sorted(held), dtype=np.uint64)}
            if under_lock is not None:
                under_lock()
            return out

    pub = KvEventPublisher("pub", "ns", queue_pages=64, linger_ms=50.0, heartbeat_s=0.2)
    try:
        pub.bind(contents)
        svc.set_sources({"pub": pub.info()})
        assert svc.wait_live(["pub"], 10)
        time.sleep(0.3)
        keys = np.arange(1, 4001, dtype=np.uint64)
        t0 = time.perf_counter()
        for a in range(0, 4000, 40):  # 100 stores of 40 pages into a 64-page queue drained every 50 ms
            with mu:
                held.update(keys[a : a + 40].tolist())
                pub.stored("l1", keys[a : a + 40])
        assert time.perf_counter() - t0 < 0.5
        assert pub.stats()["dropped_ops"] > 50
        eventually(lambda: svc.index.query(keys, "ns").of("pub").l1 == 4000, 10)
        st = svc.status()["instances"]["pub"]
        assert st["gaps"] >= 1 and st["resyncs"] >= 2 and st["live"]
    finally:
        pub.close()


def test_a_failing_apply_is_reported_and_resynced(svc: IndexService, inst: Instance) -> None:
    _join(svc, inst)
    real = svc.index.apply
    calls = [0]

    def flaky(*a: Any) -> int:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected")
        return real(*a)

    svc.index.apply = flaky  # type: ignore[method-assign]
    inst.send(inst.event((0, 1, KEYS[:6])))
    eventually(lambda: svc.status()["loop_errors"] == 1 and _matches(svc, inst) and _st(svc, inst.iid)["live"])
    assert svc.index.query(np.array(KEYS, np.uint64), "ns").of("inst-a").l1 == 6  # from the resync's snapshot


def test_a_silent_instance_stops_being_answered_for(inst: Instance) -> None:
    with IndexService(GlobalIndex(1000), snapshot_timeout_s=0.3, retry_s=0.1, silent_s=0.5) as svc:
        inst.event((0, 1, KEYS[:5]))
        _join(svc, inst)
        inst.serving = False  # it hangs: no events, no heartbeats, no snapshots
        eventually(lambda: "inst-a" not in svc.index.query(np.array(KEYS, np.uint64), "ns").per_instance, 5)
        assert svc.index.stats()["entries"] == 5  # kept until its registration ends
        inst.serving = True  # it answers again: the snapshot makes it live
        eventually(lambda: _matches(svc, inst), 5)


# -- sweeps on the sweeper thread: the loop goes on meanwhile (checked by counts: a sweep held
# between two of its parts until the test lets it go; nothing here waits on a timing) ----------


class Held:
    """The index's next sweep (a leave, a replace, age, clear_pool) held between two of its parts,
    no lock held, until `go` is set; `thread`: the thread it was running on."""

    def __init__(self, gi: GlobalIndex) -> None:
        self.gi, self.real = gi, gi._hand_over
        self.holding, self.go = threading.Event(), threading.Event()
        self.thread = ""
        gi._hand_over = self._hand_over  # type: ignore[method-assign]

    def _hand_over(self, writers: bool = False) -> None:
        if writers and not self.holding.is_set():  # writers: between the parts of a sweep
            self.thread = threading.current_thread().name
            self.holding.set()
            assert self.go.wait(30)
        self.real(writers)


@pytest.fixture
def pair(inst: Instance) -> Iterator[tuple[IndexService, Instance, Instance, Held]]:
    """inst-a (40 pages in L1, spread over the table) and inst-b, both live; the next sweep held."""
    b = Instance("inst-b")
    gi = GlobalIndex(10_000, sweep_slots=64)
    svc = IndexService(gi, snapshot_timeout_s=5.0, retry_s=0.1, silent_s=60).start()
    held = None
    try:
        inst.event((0, 1, KEYS))
        svc.set_sources({inst.iid: inst.info(), b.iid: b.info()})
        assert svc.wait_live([inst.iid, b.iid], 10)
        time.sleep(0.2)  # the SUB's subscriptions reach the PUBs (ZeroMQ's slow joiner)
        held = Held(gi)
        yield svc, inst, b, held
    finally:
        if held is not None:
            held.go.set()
        svc.close()
        b.close()


def _b_answered_during(svc: IndexService, b: Instance, held: Held) -> None:
    """b's event, sent while the sweep is held, is applied and answered over the wire before it ends."""
    b.send(b.event((0, 1, KEYS[:7])))
    with IndexClient(svc.endpoint, timeout_s=2.0) as c:
        eventually(lambda: c.query(np.array(KEYS, np.uint64), "ns").per_instance.get(b.iid) == TierPrefix(7, 7, 7))
    assert held.holding.is_set() and not held.go.is_set()
    assert _st(svc, b.iid)["seq"] == 1 and _st(svc, b.iid)["gaps"] == 0


def test_another_instance_s_event_is_applied_while_a_leave_is_held(pair: Any) -> None:
    svc, a, b, held = pair
    svc.set_sources({b.iid: b.info()})  # a leaves
    assert held.holding.wait(10)
    _b_answered_during(svc, b, held)
    assert held.thread == "l3pool-index-sweeper" and svc.status()["sweeper"]["running"] == "leave"
    assert a.iid not in svc.index.query(np.array(KEYS, np.uint64), "ns").per_instance  # out at once
    held.go.set()
    eventually(lambda: svc.status()["sweeper"]["done"]["leave"] == 1)
    assert svc.index.stats()["entries"] == 7 and svc.index.instances(live_only=False) == [b.iid]
    svc.index.check()


def test_a_resyncing_instance_s_events_during_its_replace_follow_it_in_order(pair: Any) -> None:
    """a's events sent while its snapshot is being stored are buffered, then applied after it in
    seq order (an older one skipped); none is lost: a's answer is its true state, with no resync
    beyond the one its gap asked for."""
    svc, a, b, held = pair
    lost = a.event((0, 0, KEYS[:10]))  # lost: a gap, then a resync
    a.send(a.event((1, 1, KEYS[:30])))
    assert held.holding.wait(10)
    a.send(a.event((0, 1, KEYS[:4]), (2, 1, KEYS[:20])))  # seq 4..6: after the snapshot (seq 3)
    a.send(lost)  # seq 2: older than the snapshot, skipped
    a.send(a.event((0, 0, KEYS[2:4]), (1, 0, KEYS[25:30])))
    a.send(a.event((0, 1, KEYS[10:12])))
    src = svc._src[a.iid]
    eventually(lambda: len(src.buffer) == 4)  # the loop took them in during the replace
    _b_answered_during(svc, b, held)
    assert held.thread == "l3pool-index-sweeper" and svc.status()["sweeper"]["running"] == "replace"
    assert _st(svc, a.iid)["replacing"] is True and _st(svc, a.iid)["seq"] == 1  # nothing of a's applied yet
    assert a.iid not in svc.index.query(np.array(KEYS, np.uint64), "ns").per_instance
    held.go.set()
    eventually(lambda: _st(svc, a.iid)["live"] and _st(svc, a.iid)["seq"] == 6)
    assert _matches(svc, a) and svc.index.query(np.array(KEYS, np.uint64), "ns").of(a.iid) == TierPrefix(2, 40, 40)
    st = _st(svc, a.iid)
    assert (st["resyncs"], st["gaps"], st["events"], st["dropped"], a.snapshots) == (2, 1, 3, 0, 2)
    svc.index.check()


def test_a_resyncing_instance_s_buffer_overflowing_during_its_replace_resyncs_again(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import l3pool.index.service as service

    monkeypatch.setattr(service, "MAX_BUFFERED", 2)
    svc, a, _b, held = pair
    a.event((0, 0, KEYS[:10]))  # lost
    a.send(a.event((1, 1, KEYS[:30])))
    assert held.holding.wait(10)
    for k in range(3):  # one more than the buffer holds: dropped, counted, another snapshot after
        a.send(a.event((0, 1, KEYS[k : k + 1])))
    eventually(lambda: _st(svc, a.iid)["gaps"] == 2)  # the overflow, counted during the replace
    assert _st(svc, a.iid)["dropped"] == 3
    held.go.set()
    eventually(lambda: _st(svc, a.iid)["live"] and _matches(svc, a))
    st = _st(svc, a.iid)
    assert (st["resyncs"], st["gaps"], st["seq"], a.snapshots) == (3, 2, 6, 3)


def test_a_leaving_instance_s_late_events_never_come_back(pair: Any) -> None:
    svc, a, b, held = pair
    svc.set_sources({b.iid: b.info()})
    assert held.holding.wait(10)
    a.send(a.event((0, 1, list(range(100, 120)))))  # late: a has left
    _b_answered_during(svc, b, held)
    svc.set_sources({a.iid: a.info(), b.iid: b.info()})  # and comes back: only once its leave is done
    eventually(lambda: a.iid in svc._deferred)
    assert a.iid not in svc.index.instances(live_only=False)
    held.go.set()
    eventually(lambda: _st(svc, a.iid).get("live") is True and _matches(svc, a))
    st = _st(svc, a.iid)
    assert st["resyncs"] == 1 and st["events"] == 0  # from its new snapshot, none of its late events applied
    svc.set_sources({b.iid: b.info()})  # gone for good this time
    eventually(lambda: svc.status()["sweeper"]["done"]["leave"] == 2)
    late = np.array(list(range(100, 120)) + KEYS, np.uint64)
    assert a.iid not in svc.index.query(late, "ns").per_instance
    assert svc.index.stats()["entries"] == 7  # b's only
    svc.index.check()


def test_close_during_a_held_sweep_ends_cleanly(pair: Any) -> None:
    svc, _a, b, held = pair
    svc.set_sources({b.iid: b.info()})
    assert held.holding.wait(10)
    _b_answered_during(svc, b, held)
    svc.pool_member_left()  # queued behind the leave: not run once closing
    eventually(lambda: svc.status()["sweeper"]["queued"] == 1)
    closer = threading.Thread(target=svc.close)
    closer.start()
    eventually(lambda: svc._stop.is_set())
    assert closer.is_alive()  # it waits for the sweep under way
    held.go.set()
    closer.join(30)
    assert not closer.is_alive()
    assert not [t.name for t in svc._threads if t.is_alive()]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("l3pool-index")]
    assert svc.sweeps["leave"] == 1 and svc.index.stats()["pool_clears"] == 0
    svc.index.check()
