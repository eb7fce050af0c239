"""KV events of a TieredCache (l3pool/cache/events.py): what the controller reports per tier, the
publisher's queue bound (drops counted, never blocking), its snapshots, and the wire format's
refusals. A real ZeroMQ SUB/DEALER on 127.0.0.1 reads what the publisher sends."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq

from l3pool.cache import CacheConfig, TieredCache
from l3pool.cache.events import KvEventPublisher
from l3pool.cache.tier_events import EventBatch, TierEvent
from l3pool.pool import kv_events as kv
from l3pool.pool.keys import hash_keys

from ..cache_helpers import Engine, chain
from ..fake_store import FakePageStore

pytestmark = pytest.mark.usefixtures("native")


class Recorder:
    """What a reader pulls from the cache (the controller's side of the contract): every typed
    TierEvent, in order."""

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache
        self.events: list[TierEvent] = []

    @property
    def calls(self) -> list[tuple[str, str, list[int]]]:
        self.events.extend(self.cache.take_events().events)
        return [("store" if e.stored else "remove", e.tier, e.keys.tolist()) for e in self.events]

    def keys(self, op: str, tier: str) -> set[int]:
        return {k for o, t, ks in self.calls if o == op and t == tier for k in ks}


@pytest.fixture
def sub() -> Iterator[zmq.Socket]:
    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.RCVTIMEO, 3000)
    s.setsockopt(zmq.LINGER, 0)
    yield s
    s.close()


def _snapshot(pub: KvEventPublisher, body: bytes | None = None) -> bytes:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.RCVTIMEO, 3000)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(pub.snapshot_endpoint)
    d.send(body if body is not None else kv.encode_request("snapshot"))
    try:
        return bytes(d.recv())
    finally:
        d.close()


def _attach(e: Engine) -> Recorder:
    e.cache.events.subscribe(1 << 20)
    return Recorder(e.cache)


def test_controller_reports_l1_l2_l3_stores_and_evictions() -> None:
    e = Engine(CacheConfig(), l1_pages=8, l2_pages=12, store=FakePageStore())
    try:
        rec = _attach(e)
        a = chain(1, 6)
        e.run("a", a)
        e.cache.flush()
        k = set(hash_keys(a).tolist())
        assert rec.keys("store", "l1") == k  # committed
        assert rec.keys("store", "l2") == k  # backed up (write_through)
        assert rec.keys("store", "l3") == k  # written by the writer
        b = chain(2, 8)
        e.run("b", b)  # 8 more L1 pages: a's 6 are evicted from an 8-page L1
        e.cache.flush()
        assert rec.keys("remove", "l1") == k
        c = chain(3, 8)
        e.run("c", c)
        e.cache.flush()
        assert rec.keys("remove", "l2") and rec.keys("remove", "l2") <= k | set(hash_keys(b).tolist())
        # what the sink was told adds up to what the tiers hold now
        for tier, t in (("l1", e.cache.t1), ("l2", e.cache.t2)):
            held = set(t.key64_of(np.flatnonzero(t.cached).astype(np.int64)).tolist())
            state: dict[int, bool] = {}
            for op, tt, ks in rec.calls:
                if tt == tier:
                    for x in ks:
                        state[x] = op == "store"
            assert {x for x, v in state.items() if v} == held, tier
    finally:
        e.close()


def test_no_reader_no_events_queued() -> None:
    e = Engine(CacheConfig(), l1_pages=8, l2_pages=12)
    try:
        e.run("a", chain(1, 4))  # runs with no reader at all: nothing is kept
        assert e.cache.take_events() == EventBatch()
    finally:
        e.close()


def test_events_are_typed_pulled_in_order_and_bounded() -> None:
    """take_events(): frozen TierEvents in the order of the changes; a queue over its bound drops
    whole events and says how many (the reader's gap); wake() once per empty -> non-empty."""
    e = Engine(CacheConfig(l1_to_l2="write_back"), l1_pages=8, l2_pages=12)
    woken: list[int] = []
    try:
        e.cache.events.subscribe(10, lambda: woken.append(1))
        a, b = chain(1, 6), chain(2, 6)
        e.run("a", a)
        assert len(woken) == 1
        got = e.cache.take_events()
        assert [(ev.tier, ev.stored) for ev in got.events] == [("l1", True)]
        assert got.events[0].keys.tolist() == hash_keys(a).tolist() and got.dropped_ops == 0
        with pytest.raises(AttributeError):
            got.events[0].tier = "l2"  # type: ignore[misc]
        e.run("b", b)  # 4 of a's pages evicted (and written back), then b's 6 stored: 14 pages > 10
        got = e.cache.take_events()
        assert len(woken) == 2
        assert [(ev.tier, ev.stored, len(ev.keys)) for ev in got.events] == [("l1", False, 4), ("l2", True, 4)]
        assert (got.dropped_ops, got.dropped_pages) == (1, 6)
        e.cache.events.unsubscribe()
        e.run("c", chain(3, 2))
        assert e.cache.take_events() == EventBatch()
    finally:
        e.close()


def test_publisher_sends_batches_and_snapshot_matches_its_seq(sub: zmq.Socket) -> None:
    e = Engine(CacheConfig(), l1_pages=16, l2_pages=32)
    pub = KvEventPublisher("inst-a", "ns1", linger_ms=1.0, heartbeat_s=0.2)
    try:
        pub.attach(e.cache)
        sub.connect(pub.events_endpoint)
        time.sleep(0.3)  # ZeroMQ's slow joiner: the subscription reaches the publisher
        a = chain(5, 6)
        e.run("a", a)
        e.cache.flush()
        got: set[int] = set()
        seqs = []
        deadline = time.monotonic() + 5
        while got != set(hash_keys(a).tolist()) and time.monotonic() < deadline:
            b = kv.decode_events(sub.recv())
            assert (b.instance, b.namespace, b.epoch) == ("inst-a", "ns1", pub.epoch)
            if not b.heartbeat:
                seqs.append(b.seq)
            for (tier, op, _n), ks in zip(b.ops.tolist(), np.split(b.keys, np.cumsum(b.ops[:, 2])[:-1]), strict=False):
                if tier == 0 and op == kv.STORE:
                    got |= set(ks.tolist())
        assert got == set(hash_keys(a).tolist())
        assert seqs == sorted(seqs) and all(s > 0 for s in seqs)
        snap = kv.decode_snapshot(_snapshot(pub))
        assert snap.instance == "inst-a" and snap.epoch == pub.epoch and snap.seq == pub.stats()["seq"]
        assert set(snap.tiers["l1"].tolist()) == set(hash_keys(a).tolist())
        assert set(snap.tiers["l2"].tolist()) == set(hash_keys(a).tolist())
        hb = kv.decode_events(sub.recv())  # a heartbeat within heartbeat_s, carrying the same seq
        while not hb.heartbeat:
            hb = kv.decode_events(sub.recv())
        assert hb.seq == snap.seq
        assert pub.stats()["snapshots"] == 1
    finally:
        pub.close()
        e.close()


def test_full_queue_drops_without_blocking_and_the_gap_is_visible(sub: zmq.Socket) -> None:
    pub = KvEventPublisher("inst-b", queue_pages=100, linger_ms=200.0, heartbeat_s=0.2)
    try:
        sub.connect(pub.events_endpoint)
        time.sleep(0.3)
        keys = np.arange(1, 61, dtype=np.uint64)
        t0 = time.perf_counter()
        for _ in range(1000):  # 60 pages each against a 100-page queue that drains every 200 ms
            pub.stored("l1", keys)
        spent = time.perf_counter() - t0
        st = pub.stats()
        assert st["dropped_ops"] >= 990 and st["dropped_pages"] == 60 * st["dropped_ops"]
        assert spent < 0.5, f"1000 publishes took {spent:.3f} s: the engine was blocked"
        # the next message (or heartbeat) skips a seq number: a subscriber sees the gap
        seqs = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and len(seqs) < 2:
            seqs.append(kv.decode_events(sub.recv()).seq)
        assert seqs and seqs[-1] >= 2, seqs  # one message sent (seq 1) + the drop's skipped number
    finally:
        pub.close()


def test_snapshot_requests_that_are_malformed_get_an_error_reply() -> None:
    pub = KvEventPublisher("inst-c")
    try:
        for body in (b"\xc1garbage", msgpack.packb([9, "snapshot"]), kv.encode_request("dump")):
            with pytest.raises(kv.WireError, match="error"):
                kv.decode_snapshot(_snapshot(pub, body))
        assert kv.decode_snapshot(_snapshot(pub)).seq == 0  # still serving
    finally:
        pub.close()


def test_publisher_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="instance id"):
        KvEventPublisher("has space")
    with pytest.raises(ValueError, match="queue_pages"):
        KvEventPublisher("x", queue_pages=0)
    with pytest.raises(ValueError, match="heartbeat_s"):
        KvEventPublisher("x", heartbeat_s=0)
    pub = KvEventPublisher("x")
    try:
        with pytest.raises(KeyError):
            pub.stored("l4", np.arange(3, dtype=np.uint64))
    finally:
        pub.close()


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        (b"\xc1", "msgpack"),
        (msgpack.packb({"a": 1}), "array"),
        (msgpack.packb([2, "ev"]), "wire version"),
        (msgpack.packb([1, "ev", "", 1, 1, "", [], b"", 0.0]), "instance"),
        (msgpack.packb([1, "ev", "i", -1, 1, "", [], b"", 0.0]), "non-negative"),
        (msgpack.packb([1, "ev", "i", 1, 1, "", [0, 1], b"", 0.0]), "triples"),
        (msgpack.packb([1, "ev", "i", 1, 1, "", [3, 1, 1], b"\0" * 8, 0.0]), "tier must be"),
        (msgpack.packb([1, "ev", "i", 1, 1, "", [0, 1, 2], b"\0" * 8, 0.0]), "2 keys in one op, 1 given"),
        (msgpack.packb([1, "ev", "i", 1, 1, "", [0, 1, 1], b"\0" * 7, 0.0]), "8-byte keys"),
        (msgpack.packb([1, "ev", "i", 1, 1, "", [], b"\0" * 8, 0.0]), "heartbeat"),
        (msgpack.packb([1, "ev", "i", 1, 1, "", [], b"", "now"]), "sent_at"),
    ],
)
def test_malformed_event_messages_are_refused(msg: bytes, why: str) -> None:
    with pytest.raises(kv.WireError, match=why):
        kv.decode_events(msg)


def test_keys64_refuses_wrong_hash_lengths() -> None:
    assert kv.keys64([b"\1" * 16, b"\2" * 16]).tolist() == [
        int.from_bytes(b"\1" * 8, "little"),
        int.from_bytes(b"\2" * 8, "little"),
    ]
    for bad in ([b"\1" * 16, b"\2" * 8], [b"\1" * 5], ["str"], np.arange(3), b"\0" * 7):
        with pytest.raises(ValueError):
            kv.keys64(bad)  # type: ignore[arg-type]


def test_the_publisher_imports_without_torch() -> None:
    """A process that only publishes KV events (or a tool) does not pay for torch: l3pool.cache
    loads its names lazily."""
    import subprocess
    import sys

    from l3pool.procenv import python_env

    code = (
        "import sys; from l3pool.cache.events import KvEventPublisher, EventOptions; "
        "from l3pool.cache import KvEventPublisher as K; assert K is KvEventPublisher; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "from l3pool.cache import TieredCache; assert 'torch' in sys.modules; print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_publisher_never_takes_the_caches_lock() -> None:
    """It pulls through `cache.events` (CacheEvents takes the lock itself): no `_mu` of the cache,
    no sink the cache calls, in events.py."""
    from pathlib import Path

    from l3pool.cache import events

    src = Path(events.__file__).read_text()
    assert "cache._mu" not in src and "cache.mu" not in src and "cache.events =" not in src
    assert "._source.take()" in src and "._source.snapshot()" in src
