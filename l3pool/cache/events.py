"""KV events of one engine instance: `KvEventPublisher`, the reader of a TieredCache's tier events.

    pub = KvEventPublisher("prefill-0", namespace=ns.ns_id)      # binds tcp://127.0.0.1:* twice
    pub.attach(stack.cache)                                   # it pulls the cache's tier changes
    pub.register(metadata, ttl=10)                            # {prefix}/kv_events/prefill-0, leased
    ...
    pub.close()                                               # deregisters, stops the thread

The cache queues its tier changes itself (typed `TierEvent`s in a bounded queue of `queue_pages`
pages, l3pool/cache/tier_events.py) and wakes the publisher when the queue stops being empty; the
publisher pulls them (`cache.events.take()`) and never takes the cache's lock. `stored` /
`removed` queue changes directly (a source that is not a cache). A full queue drops the operation
(counted in `stats()` and `l3pool_kv_events_dropped_total`) and the next message skips a sequence
number, so every subscriber sees the gap and resynchronises from a snapshot (which heals the loss). One background
thread owns both ZeroMQ sockets: it batches the queue into one message per `linger_ms` (one
msgpack frame: ops + one uint64 key buffer, l3pool/pool/kv_events.py), sends without blocking (a
subscriber at its high-water mark loses messages, again a gap), sends a heartbeat every
`heartbeat_s` (so a lost last message is seen too) and answers snapshot requests on its ROUTER
socket: the cache's L1/L2 contents and the changes queued before them, taken by the cache in one
step (`cache.events.snapshot()`), sent first, so the snapshot is exactly the state as of its
sequence number. L3 has no removal events (the pool evicts
without telling the cache): the publisher keeps its last `l3_hints` L3 writes in a ring and sends
them in snapshots as hints (docs/design.md, "KV events and the global index").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from l3pool import metrics
from l3pool.pool.kv_events import (
    REMOVE,
    STORE,
    TIER_CODES,
    SourceInfo,
    WireError,
    check_namespace,
    decode_request,
    encode_error,
    encode_events,
    encode_snapshot,
    new_epoch,
)

if TYPE_CHECKING:
    from l3pool.cache.controller import TieredCache
    from l3pool.cache.tier_events import CacheEvents, EventBatch
    from l3pool.pool.etcd import LeaseKeeper
    from l3pool.pool.metadata import Metadata

log = logging.getLogger(__name__)

# a source that is not a cache (bind()): its tiers' contents now, `under_lock()` run while nothing can change
Contents = Callable[[Callable[[], None]], dict[str, np.ndarray]]


def _zmq() -> Any:
    try:
        import zmq
    except ModuleNotFoundError:  # pragma: no cover - the `index` extra installs it
        raise RuntimeError("KV events need pyzmq: pip install 'l3pool[index]'") from None
    return zmq


@dataclass(frozen=True)
class EventOptions:
    """The KV-event publisher `l3pool.cache.build(events=...)` makes for a stack: the instance id
    the index knows it by, where its two sockets bind (port 0: any free one), and `registry` (a
    `Metadata`: the publisher registers `{prefix}/kv_events/{instance_id}` there under a lease of
    `ttl` s, which is how an index finds it; None: the caller hands `publisher.info()` over)."""

    instance_id: str
    host: str = "127.0.0.1"
    events_port: int = 0
    snapshot_port: int = 0
    registry: Metadata | None = None
    ttl: int = 10
    linger_ms: float = 2.0
    heartbeat_s: float = 1.0

    def publisher(self, namespace: str = "") -> KvEventPublisher:
        return KvEventPublisher(
            self.instance_id, namespace, host=self.host, events_port=self.events_port,
            snapshot_port=self.snapshot_port, linger_ms=self.linger_ms, heartbeat_s=self.heartbeat_s,
        )  # fmt: skip


class KvEventPublisher:
    def __init__(
        self,
        instance_id: str,
        namespace: str = "",
        *,
        host: str = "127.0.0.1",
        events_port: int = 0,
        snapshot_port: int = 0,
        queue_pages: int = 1 << 20,
        linger_ms: float = 2.0,
        heartbeat_s: float = 1.0,
        l3_hints: int = 1 << 18,
        sndhwm: int = 100_000,
    ) -> None:
        from l3pool.pool.metadata import check_id

        check_id("instance id", instance_id)
        check_namespace(namespace)  # what the index accepts (a WireError is a ValueError)
        for name, v in (("queue_pages", queue_pages), ("l3_hints", l3_hints), ("sndhwm", sndhwm)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not linger_ms >= 0 or not heartbeat_s > 0:
            raise ValueError("linger_ms must be >= 0 and heartbeat_s > 0")
        zmq = _zmq()
        self.instance, self.namespace, self.epoch = instance_id, namespace, new_epoch()
        self.queue_pages, self.linger_s, self.heartbeat_s = queue_pages, linger_ms / 1e3, heartbeat_s
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, sndhwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._snap = self._ctx.socket(zmq.ROUTER)
        self._snap.setsockopt(zmq.LINGER, 0)
        try:
            self.events_endpoint = self._bind(self._pub, host, events_port)
            self.snapshot_endpoint = self._bind(self._snap, host, snapshot_port)
        except BaseException:
            self._pub.close()
            self._snap.close()
            raise
        self._mu = threading.Lock()  # the queue (engine threads append, the sender swaps it)
        self._ops: list[tuple[int, int, np.ndarray]] = []
        self._queued = 0
        self._first_at = 0.0
        self._gap = False  # ops were dropped since the last message: the next one skips a seq
        self._seq = 0  # last seq assigned (sender thread only, or under the cache's lock at a snapshot)
        self._ring = np.zeros(l3_hints, dtype=np.uint64)  # recent L3 writes (hints)
        self._ring_n = 0
        self._source: CacheEvents | None = None  # the cache whose events it pulls (attach)
        self._contents: Contents | None = None  # or another source's contents (bind)
        self.sent = self.pages = self.dropped_ops = self.dropped_pages = self.snapshots = 0
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._stop = False
        self._keeper: LeaseKeeper | None = None
        self._reg: tuple[Metadata, int] | None = None
        self._thread = threading.Thread(target=self._run, name="l3pool-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock: Any, host: str, port: int) -> str:
        sock.bind(f"tcp://{host}:{port if port else '*'}")
        ep: bytes = sock.getsockopt(_zmq().LAST_ENDPOINT)
        return ep.decode()

    # -- the events' sources ------------------------------------------------------------------------
    def bind(self, contents: Contents) -> None:
        """A source that is not a cache: it reports through stored() / removed(), its snapshots
        read `contents`."""
        self._contents = contents

    def attach(self, cache: TieredCache) -> None:
        """Pull `cache`'s tier changes from now on (its snapshots read the cache's tiers)."""
        if self._source is not None:
            raise ValueError("this publisher already reads a cache")
        self._source = cache.events
        self._source.subscribe(self.queue_pages, self._wake)

    def _wake(self) -> None:  # the cache calls it under its lock: never blocks
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):
            pass

    def _pull(self, batch: EventBatch) -> None:
        """Queue what the cache took for the next message (the cache's drops are a gap too)."""
        for ev in batch.events:
            self._put(ev.tier, STORE if ev.stored else REMOVE, ev.keys)
        if batch.dropped_ops:
            with self._mu:
                self.dropped_ops += batch.dropped_ops
                self.dropped_pages += batch.dropped_pages
                self._gap = True
            metrics.KV_EVENTS_DROPPED.inc(batch.dropped_ops)

    def stored(self, tier: str, keys: np.ndarray) -> None:
        self._put(tier, STORE, keys)

    def removed(self, tier: str, keys: np.ndarray) -> None:
        self._put(tier, REMOVE, keys)

    def _put(self, tier: str, op: int, keys: np.ndarray) -> None:
        code = TIER_CODES[tier]
        n = len(keys)
        if not n:
            return
        k = np.array(keys, dtype=np.uint64)  # a copy: the caller's buffer may change
        with self._mu:
            if code == 2 and op == STORE:
                self._remember_l3(k)
            if self._queued + n > self.queue_pages:
                self.dropped_ops += 1
                self.dropped_pages += n
                self._gap = True
                metrics.KV_EVENTS_DROPPED.inc()
                return
            wake = not self._ops
            if wake:
                self._first_at = time.time()  # the batch's oldest operation (the event lag's start)
            self._ops.append((code, op, k))
            self._queued += n
        if wake:
            self._wake()

    def _remember_l3(self, k: np.ndarray) -> None:
        cap = len(self._ring)
        k = k[-cap:]
        at = self._ring_n % cap
        first = min(len(k), cap - at)
        self._ring[at : at + first] = k[:first]
        self._ring[: len(k) - first] = k[first:]
        self._ring_n += len(k)

    # -- the sender thread ----------------------------------------------------------------------
    def _take(self, pull: bool = True) -> tuple[list[int], bytes, int, float | None]:
        if pull and self._source is not None:
            self._pull(self._source.take())
        with self._mu:
            ops, self._ops, n, self._queued = self._ops, [], self._queued, 0
            gap, self._gap = self._gap, False
            first = self._first_at
        if gap:
            self._seq += 1  # consumed by the dropped ops: subscribers see the gap
        if not ops:
            return [], b"", 0, None
        flat = [x for code, op, k in ops for x in (code, op, len(k))]
        return flat, np.concatenate([k for _, _, k in ops]).astype("<u8", copy=False).tobytes(), n, first

    def _send(self, heartbeat: bool = False, pull: bool = True) -> None:
        zmq = _zmq()
        flat, keys, n, first = self._take(pull)
        if not flat and not heartbeat:
            return
        if flat:
            self._seq += 1
        msg = encode_events(self.instance, self.epoch, self._seq, self.namespace, flat, keys, first)
        self._last_send = time.monotonic()  # also on failure: the loop's heartbeat timer must not spin
        try:
            self._pub.send(msg, zmq.NOBLOCK)
        except zmq.Again:  # a subscriber's queue is full: it sees the gap
            if flat:
                self.dropped_ops += len(flat) // 3
                self.dropped_pages += n
                metrics.KV_EVENTS_DROPPED.inc(len(flat) // 3)
            return
        if flat:
            self.sent += 1
            self.pages += n
            metrics.KV_EVENTS_SENT.inc()
            metrics.KV_EVENT_PAGES.inc(n)

    def _run(self) -> None:
        zmq = _zmq()
        poller = zmq.Poller()
        poller.register(self._snap, zmq.POLLIN)
        poller.register(self._rfd, zmq.POLLIN)
        self._last_send = time.monotonic()
        due: float | None = None  # when the queued ops go out
        while not self._stop:
            now = time.monotonic()
            wait = self.heartbeat_s - (now - self._last_send)
            if due is not None:
                wait = min(wait, due - now)
            try:
                ready = dict(poller.poll(max(0, int(wait * 1e3) + (0 if due is not None else 1))))
            except zmq.ZMQError:
                return
            if self._stop:
                return
            now = time.monotonic()
            if self._rfd in ready:
                os.read(self._rfd, 4096)
                if due is None:
                    due = now + self.linger_s
            if self._snap in ready:
                self._serve()
            with self._mu:
                pending = bool(self._ops)
            if pending and due is None:
                due = now + self.linger_s
            if due is not None and now >= due:
                self._send()
                due = None
            if time.monotonic() - self._last_send >= self.heartbeat_s:
                self._send(heartbeat=True)

    def _serve(self) -> None:
        zmq = _zmq()
        while True:
            try:
                frames = self._snap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            route, body = frames[:-1], frames[-1]
            try:
                req = decode_request(body)
                if req[0] != "snapshot":
                    raise WireError(f"unknown request {req[0]!r}")
                reply = self._snapshot()
            except WireError as e:
                reply = encode_error(str(e))
            except Exception as e:  # the cache failed: say so, keep serving
                log.warning("KV events: snapshot failed: %s", e)
                reply = encode_error(f"snapshot failed: {e}")
            try:
                self._snap.send_multipart([*route, reply], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("KV events: snapshot reply not sent: %s", e)

    def _snapshot(self) -> bytes:
        seq = [0]

        def send_first() -> None:
            self._send(pull=False)  # also consumes a pending gap's seq number
            seq[0] = self._seq

        tiers: dict[str, np.ndarray] = {}
        if self._source is not None:  # the contents, and the changes before them sent first
            tiers, before = self._source.snapshot()
            self._pull(before)
            send_first()
        elif self._contents is not None:
            tiers = dict(self._contents(send_first))
        else:
            send_first()
        with self._mu:
            cap = len(self._ring)
            tiers["l3"] = self._ring[: min(self._ring_n, cap)].copy()
        self.snapshots += 1
        metrics.KV_SNAPSHOTS_SERVED.inc()
        return encode_snapshot(self.instance, self.epoch, seq[0], self.namespace, tiers)

    # -- registration, stats, close -------------------------------------------------------------
    def info(self) -> SourceInfo:
        return SourceInfo(self.instance, self.events_endpoint, self.snapshot_endpoint, self.namespace, self.epoch)

    def register(self, metadata: Metadata, ttl: int = 10) -> None:
        """Publish the endpoints under `{prefix}/kv_events/{instance}` (leased; registered again
        by the sender's watchdog when the lease is lost)."""
        self._keeper = metadata.register_kv_source(self.info(), ttl)
        self._reg = (metadata, ttl)
        threading.Thread(target=self._watch_lease, name="l3pool-kv-events-lease", daemon=True).start()

    def _watch_lease(self) -> None:
        while not self._stop and self._reg is not None:
            k = self._keeper
            if k is not None and k.lost.wait(0.5) and not self._stop:
                md, ttl = self._reg
                try:
                    self._keeper = md.register_kv_source(self.info(), ttl)
                    log.warning("KV events: lease lost, registered %s again", self.instance)
                except Exception as e:
                    log.warning("KV events: registering %s again failed: %s", self.instance, e)
                    time.sleep(1.0)

    def stats(self) -> dict[str, Any]:
        with self._mu:
            queued = self._queued
        return {
            "instance": self.instance,
            "epoch": self.epoch,
            "seq": self._seq,
            "sent": self.sent,
            "pages": self.pages,
            "queued_pages": queued,
            "dropped_ops": self.dropped_ops,
            "dropped_pages": self.dropped_pages,
            "snapshots": self.snapshots,
            "events": self.events_endpoint,
            "snapshot": self.snapshot_endpoint,
        }

    def close(self) -> None:
        if self._stop:
            return
        reg, self._reg = self._reg, None
        if reg is not None:
            try:
                reg[0].deregister_kv_source(self.instance, self._keeper)
            except Exception as e:
                log.warning("KV events: deregistering %s failed: %s", self.instance, e)
        self._stop = True
        if self._source is not None:
            self._source.unsubscribe()
        try:
            os.write(self._wfd, b"x")
        except OSError:
            pass
        self._thread.join(5)
        self._pub.close()
        self._snap.close()
        os.close(self._rfd)
        os.close(self._wfd)

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
